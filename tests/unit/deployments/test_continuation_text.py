"""A migrated stream's text, replayed in the ingress, against vLLM's own detokenizer: the text a client
gets from the dead replica up to any token plus `ContinuationText` from there is exactly what vLLM's
`FastIncrementalDetokenizer` gives an untouched run, on token sequences full of incomplete UTF-8 (the
tiny model's usual output); priming vLLM's detokenizer with the continuation prompt does not."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvmesh.deployments.continuation_text import ContinuationText, rust_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    where = Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0"
    return AutoTokenizer.from_pretrained(build_tiny_model(where))


def _vllm_texts(tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    """The text vLLM's detokenizer streams for each of `output`'s tokens after `prompt`."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1))
    detok = FastIncrementalDetokenizer(tokenizer, request)
    return [detok.decode_next(t) for t in output]


def _draw(tokenizer, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    return [rng.choice(vocab) for _ in range(48)], [rng.choice(vocab) for _ in range(80)]


def test_replayed_text_continues_exactly_where_the_dead_replica_stopped(tokenizer):
    naive_differs = 0
    for seed in range(6):
        prompt, output = _draw(tokenizer, seed)
        texts = _vllm_texts(tokenizer, prompt, output)
        assert "\ufffd" in "".join(texts)  # the case at hand: invalid and incomplete UTF-8 in the output
        for k in range(1, len(output)):
            want = "".join(texts[k:])
            got = ContinuationText(rust_tokenizer(tokenizer), prompt, output[:k]).text(output[k:])
            assert got == want, (seed, k)
            naive = "".join(_vllm_texts(tokenizer, prompt + output[:k], output[k:]))
            naive_differs += naive != want
    assert naive_differs  # the new replica's own text would have been wrong somewhere


def test_a_tokenizer_without_a_fast_backend_is_refused():
    with pytest.raises(TypeError, match="fast"):
        rust_tokenizer(object())

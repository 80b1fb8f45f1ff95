"""Helpers shared by the isolation tests: a prefill-heavy variant of the tiny model, a synchronous
single-request runner over a real in-process vLLM engine, and a Mann-Whitney U test.

Why a heavier variant: the tiny model (hidden 128, 2 layers) prefills 2k tokens about as fast as the
engine's per-step overhead, so a cache hit barely changes TTFT and a timing test would prove nothing.
Hidden 256 makes prefill dominate (cold ~0.4 s vs warm ~0.1 s for 1.9k tokens here) while keeping an
engine to a few hundred MB. Same tokenizer and chat template as the tiny model.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

ENGINE_ENV = {
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
HEAVY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
BLOCK_SIZE = 32


def set_engine_env(tmp_root: Path) -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_root / "vllm-cache"))


def build_prefill_heavy_model(out_dir: Path) -> Path:
    """The tiny model's tokenizer with a wider random Llama (deterministic, seed 0)."""
    from kvmesh.deployments.tiny_model import build_tiny_model

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tiny = build_tiny_model(out_dir.parent / "tiny")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base.get("pad_token_id"),
        tie_word_embeddings=False,
        **HEAVY_SHAPE,
    )
    torch.manual_seed(0)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(tmp, safe_serialization=True)
    for f in tiny.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "kvmesh_tiny.json"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out_dir)
    return out_dir


class EngineRunner:
    """One real vLLM LLMEngine, driven one request at a time (so TTFT is not shared with others)."""

    def __init__(self, model: Path, kv_transfer_config: dict | None = None, max_model_len: int = 2048):
        from vllm import EngineArgs, LLMEngine
        from vllm.config import KVTransferConfig

        args = EngineArgs(
            model=str(model),
            block_size=BLOCK_SIZE,
            max_model_len=max_model_len,
            enforce_eager=True,
            enable_prefix_caching=True,
            dtype="float32",
            max_num_seqs=4,
            seed=0,
            kv_transfer_config=KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None,
        )
        # vLLM leaves its torch.distributed file store in the temp folder; keep it beside the model.
        # and starts whether or not numba's llvmlite is loaded in this process (kvstore/compat.py)
        from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup

        patch_llvmlite_dunder_lookup()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tempfile, "tempdir", str(model.parent))
            mp.setenv("VLLM_RPC_BASE_PATH", str(model.parent))
            self.engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()
        from transformers import AutoTokenizer

        self.vocab = len(AutoTokenizer.from_pretrained(str(model)))

    def run(self, token_ids: list[int], salt: str | None, timeout_s: float = 120.0) -> tuple[int, float]:
        """-> (cached prompt tokens the engine reports, seconds to the first (only) token)."""
        from vllm import SamplingParams

        rid = f"iso-{next(self._ids)}"
        prompt = {"prompt_token_ids": list(token_ids)}
        if salt is not None:
            prompt["cache_salt"] = salt
        start = time.perf_counter()
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while time.perf_counter() - start < timeout_s:
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    return int(out.num_cached_tokens or 0), time.perf_counter() - start
        raise TimeoutError(f"request {rid} did not finish in {timeout_s} s")

    def shutdown(self) -> None:
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.engine = None


def full_blocks_cached(n_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """What a complete prefix hit reports: every full block, but vLLM always recomputes the last token."""
    return (n_tokens - 1) // block_size * block_size


def mann_whitney_u(x: list[float], y: list[float], alternative: str = "two-sided") -> tuple[float, float]:
    """Mann-Whitney U with tie correction and the normal approximation (fine for n >= 8 each).
    Returns (U of x, p). alternative: 'two-sided' or 'less' (x tends to be smaller than y)."""
    n1, n2 = len(x), len(y)
    pooled = sorted((v, i) for i, v in enumerate(list(x) + list(y)))
    ranks = [0.0] * (n1 + n2)
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        avg = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[pooled[k][1]] = avg
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    r1 = sum(ranks[:n1])
    u1 = r1 - n1 * (n1 + 1) / 2
    mu = n1 * n2 / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))))
    if sigma == 0:
        return u1, 1.0
    z = (u1 - mu) / sigma
    cdf = 0.5 * math.erfc(-z / math.sqrt(2))
    if alternative == "less":
        return u1, cdf
    if alternative == "two-sided":
        return u1, min(1.0, 2 * min(cdf, 1 - cdf))
    raise ValueError(alternative)

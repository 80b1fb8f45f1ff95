"""bench_live's targets: it passes and misses on the figures it is given."""

from __future__ import annotations

import pytest

from kvmesh.cluster import workloads as wl

ENV = {
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


# ----------------------------------------------------------------------------- integration


CHAT = wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, system_blocks=6, seed=11)


def test_bench_live_targets_pass_and_miss():
    from kvmesh.benchmarks.bench_live import evaluate

    def summary(uncached, hit, p50, errors=0):
        return {"uncached_prompt_tokens": uncached, "hit_rate_tokens": hit, "ttft_p50_s": p50, "errors": errors}

    good = evaluate({"kvmesh": summary(50, 0.7, 0.07), "round_robin": summary(100, 0.4, 0.1)}, bound_hit_rate=0.75)
    assert [ok for *_, ok in good] == [True, True, True, True]
    assert good[0][1] == pytest.approx(0.5) and good[1][1] == pytest.approx(0.7 / 0.75)
    bad = evaluate({"kvmesh": summary(70, 0.6, None, errors=1), "round_robin": summary(100, 0.4, 0.1)}, 0.75)
    assert [ok for *_, ok in bad] == [False, False, False, False]  # a missing TTFT is a miss, not a pass

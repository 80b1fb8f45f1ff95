"""A real engine replica whose LMCache server restarts before the engine has served anything still
stores to, and loads from, the restarted server.

Why: LMCache's connector re-registers its engine's KV caches with a restarted server only when its
heartbeat saw the server go away, and it starts that heartbeat with its first store, retrieve or event
poll, i.e. the engine's first request. A server restarted in between (the node actor's watchdog, a
crash) left the engine talking to a server that never heard of it: every store and retrieve waited out
the message-queue timeout, and nothing was cached in the tiers. The engine replica now runs one
one-token request when its engine is built, so the heartbeat runs from the start.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.tiers import TierConfig, kv_transfer_config

pytestmark = pytest.mark.integration

BLOCK = 32


async def _generate(replica, tokens: list[int], rid: str) -> dict:
    request = {"request_id": rid, "prompt_token_ids": tokens, "params": {"max_tokens": 1}}
    return [c async for c in replica.generate(request)][-1]


async def _reset_prefix_cache(replica, within_s: float = 60) -> None:
    """vLLM refuses while blocks are held, and a block stays held until LMCache has stored it."""
    deadline = time.monotonic() + within_s
    while not (await replica.reset_prefix_cache())["reset"]:
        assert time.monotonic() < deadline, "the engine kept its blocks: a store never finished"
        await asyncio.sleep(0.2)


async def _cached_after_a_reset(replica, server, rng: random.Random) -> list[tuple[float, int]]:
    """Fresh prompts, each sent, dropped from the engine's cache and sent again, until the second send
    loads it from the server (or 90 s pass). Returns (seconds, cached tokens of the second send) per try."""
    deadline = time.monotonic() + 90
    attempts: list[tuple[float, int]] = []
    while not attempts or (attempts[-1][1] == 0 and time.monotonic() < deadline):
        if attempts:
            await asyncio.sleep(2)  # the heartbeat sees the restarted server within one interval
        prompt = [rng.randrange(10, 1000) for _ in range(8 * BLOCK)]
        t0 = time.monotonic()
        first = await asyncio.wait_for(_generate(replica, prompt, f"first-{len(attempts)}"), 120)
        assert first["num_cached_tokens"] == 0
        await _reset_prefix_cache(replica)
        again = await asyncio.wait_for(_generate(replica, prompt, f"again-{len(attempts)}"), 120)
        attempts.append((round(time.monotonic() - t0, 1), again["num_cached_tokens"]))
    return attempts


@pytest.mark.parametrize("engine_mode", ["inproc", "async"])
def test_a_server_restarted_before_the_engines_first_request_gets_its_stores(
    engine_mode, tiny_model_dir, tmp_path, monkeypatch
):
    from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV, write_channel_secret
    from kvmesh.deployments.engine import EngineReplica

    monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(write_channel_secret(tmp_path / "run")))
    cfg = TierConfig.from_dict({"l1_size_gb": 0.05, "chunk_size": BLOCK, "start_timeout_s": 300})
    server = LMCacheServer(cfg, tmp_path / "lmcache.log")
    server.start()
    replica = None

    async def scenario():
        nonlocal replica
        # built on a running loop, as Serve builds a replica: the async engine starts its warm-up there
        replica = EngineReplica(
            {
                "model": "tiny",
                "num_gpu_blocks_override": 64,
                "max_model_len": 1024,
                "engine_mode": engine_mode,
                "kv_transfer_config": kv_transfer_config(*server.endpoint),
            }
        )
        if getattr(replica.driver, "warm_up", None) is not None:
            await replica.driver.warm_up
        endpoint = server.endpoint
        assert server.restart() == endpoint  # before the engine has served a single request
        return await _cached_after_a_reset(replica, server, random.Random(7))

    try:
        attempts = asyncio.run(scenario())
        cached = attempts[-1][1]
        # the engine's own cache was dropped, so these came from the restarted server's host tier
        assert cached >= 7 * BLOCK, attempts
        assert server.tier_metrics()["host_hit_tokens"] >= cached, attempts
        # a store or retrieve for an engine the server does not know waits out the message-queue timeout
        assert attempts[-1][0] < 15, attempts
    finally:
        if replica is not None:
            replica.driver.shutdown()  # the engine before its server: a connector waits for a gone server
            replica._release()
        server.stop()

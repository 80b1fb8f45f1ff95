"""Sent requests and reports made up for the cachetest report tests (no server, no tokenizer)."""

import random

from kvmesh.cluster.cachetest_analysis import Prepared, Sent
from kvmesh.cluster.cachetest_report import PassRun, Rates, build_report
from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass
from kvmesh.cluster.request_log import LoggedRequest

B = 32


def fake_runs(n_requests=60, seed=0, server=False):
    """Two tenants, conversations sharing a system prompt; cold then warm with made-up cached counts."""
    rng = random.Random(seed)
    systems = {t: [rng.randrange(10, 900) for _ in range(70)] for t in ("a", "b")}
    prepared = []
    for i in range(n_requests):
        tenant = "ab"[i % 2]
        ids = systems[tenant] + [rng.randrange(10, 900) for _ in range(rng.randint(5, 80))]
        req = LoggedRequest(f"r{i}", {"prompt": ids}, "/v1/completions", tenant, f"conv{i % 7}")
        prepared.append(Prepared(req, TokenizedRequest(i, req.id, tenant, None, ids)))
    hash_requests([p.tok for p in prepared], B)
    runs, clock = [], 0.0
    for name in ("cold", "warm"):
        sent = []
        for p in prepared:
            n = p.tok.n
            cached = 0 if name == "cold" else rng.choice([0, 32, 64, ((n - 1) // B) * B])
            err = "HTTP 500: boom" if rng.random() < 0.03 else None
            sent.append(Sent(p, name, clock, None if err else clock + 0.02, n, None if err else cached, "rep0", err))
            clock += 0.05
        counters = ({"evictions": 0}, {"evictions": 3, "host_hit_tokens": 64}) if server else ({}, {})
        runs.append(PassRun(name, sent, 2.0, 4, 50, *counters, {p.req.id: "out" for p in prepared}))
    return prepared, runs


def sample_report(server=False):
    """A report built from `fake_runs` (decode shows token ids as numbers)."""
    prepared, runs = fake_runs(server=server)
    offline = offline_pass([p.tok for p in prepared], B)
    return build_report(runs, offline, Rates(3.0, 0.3), B, decode=lambda ids: " ".join(map(str, ids)))

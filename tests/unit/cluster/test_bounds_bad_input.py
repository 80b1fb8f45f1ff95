"""Round robin over more replicas than the trace has requests: the same bound, in memory for the requests
only (a fleet size typed with extra digits must not allocate a cache per replica)."""

from __future__ import annotations

import tracemalloc

from kvmesh.cluster.bounds import record_bounds, round_robin_infinite_hits
from kvmesh.cluster.trace import TraceRequest


def _requests() -> list[TraceRequest]:
    shared = list(range(8))
    return [TraceRequest(i, 9 * 32 + 1, 4, shared + [100 + i]) for i in range(6)]


def test_replicas_beyond_the_requests_cost_no_memory_and_change_nothing():
    reqs = _requests()
    exact = round_robin_infinite_hits(reqs, 32, replicas=len(reqs), warmup=1)
    tracemalloc.start()
    try:
        many = round_robin_infinite_hits(reqs, 32, replicas=1_000_000, warmup=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert many == exact and exact == (0, 5 * (9 * 32 + 1))
    assert peak < 1_000_000, peak  # a set per replica would take ~200 MB
    assert round_robin_infinite_hits(reqs, 32, replicas=2) != exact  # the bound does depend on replicas below


def test_record_bounds_reports_the_fleet_it_was_asked_for():
    records = [{"timestamp": i, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 2]} for i in range(3)]
    result = record_bounds(records, 512, replicas=1_000_000)
    assert result["round_robin_infinite"] == {"replicas": 1_000_000, "cached_tokens": 0, "hit_rate": 0.0}
    assert record_bounds(records, 512, replicas=1)["round_robin_infinite"]["cached_tokens"] == 2 * 1024

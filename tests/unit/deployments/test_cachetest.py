"""The cachetest runner's pure parts: partial-pass prompts and the demo's report from replayed runs."""

from kvmesh.cluster.cachetest_analysis import Prepared
from kvmesh.cluster.prefix_share import TokenizedRequest
from kvmesh.cluster.request_log import LoggedRequest
from kvmesh.deployments.cachetest import partial_variants, report_from_replays
from kvmesh.deployments.replay import ReplayReport, RequestResult

B = 32


def test_partial_variants_keep_whole_blocks_or_half_a_block_more_and_change_every_later_token():
    ids = list(range(10, 10 + 5 * B + 7))
    p = Prepared(LoggedRequest("a", {"prompt": ids}, "/v1/completions", "t"), TokenizedRequest(0, "a", "t", None, ids))
    (boundary,) = partial_variants([p], B, False, 1024)
    (mid,) = partial_variants([p], B, True, 1024)
    for v, keep in ((boundary, 4 * B), (mid, 4 * B + B // 2)):
        assert v.tok.ids[:keep] == ids[:keep] and len(v.tok.ids) == len(ids)
        assert all(a != b for a, b in zip(v.tok.ids[keep:], ids[keep:]))
        assert v.origin is p and v.req.body["prompt"] == v.tok.ids and v.tok.salted


def test_the_demo_report_treats_each_run_as_a_fresh_server():
    records = [
        {"timestamp": i, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2, 3 + i], "user": "u"}
        for i in range(4)
    ]
    replays = {}
    for name, cached in (("kvmesh", [0, 64, 64, 64]), ("round_robin", [0, 0, 64, 0])):
        results = [
            RequestResult(i, "u", None, 96, c, 4, 0.01, 0.02, f"r{i % 2}", None, float(i), "out")
            for i, c in enumerate(cached)
        ]
        replays[name] = ReplayReport(results, 5.0)
    rep = report_from_replays(records, replays, 32, B)
    kv, rr = rep["passes"]["kvmesh"], rep["passes"]["round_robin"]
    assert kv["cached_tokens"] == 192 and rr["cached_tokens"] == 64
    # the second run's first request is cold again (a fresh server), not "computed before"
    first_rr = next(r for r in rep["requests"] if r["pass"] == "round_robin")
    assert first_rr["miss_tokens"] == {"cold": 64, "partial_block": 32}
    assert rep["summary"]["pass"] == "kvmesh" and rep["summary"]["cost_change_vs_round_robin"] < 0
    assert rep["correctness"]["ok"] is None  # no cold/warm pair in a demo


def test_the_demo_report_splits_hits_by_tier_from_each_runs_counters():
    from kvmesh.deployments.cachetest import counters_from_state

    records = [
        {"timestamp": i, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2, 3 + i], "user": "u"}
        for i in range(3)
    ]
    results = [
        RequestResult(i, "u", None, 96, c, 4, 0.01, 0.02, "r0", None, float(i), "out")
        for i, c in enumerate([0, 64, 64])
    ]
    replays = {"plain": ReplayReport(results, 1.0), "tiered": ReplayReport(results, 1.0)}
    plain_state = {"router": {"index": {"evictions": 3}}, "tiers": None}  # no LMCache: tier figures absent
    tiered_state = {"router": {"index": {}}, "tiers": {"host_hit_tokens": 32, "shared_hit_tokens": 64, "up": "x"}}
    counters = {"plain": counters_from_state(plain_state), "tiered": counters_from_state(tiered_state)}
    assert counters["tiered"] == {"evictions": 0, "host_hit_tokens": 32, "shared_hit_tokens": 64}
    rep = report_from_replays(records, replays, 32, B, counters=counters)
    plain, tiered = rep["passes"]["plain"], rep["passes"]["tiered"]
    assert plain["hits_by_tier"] == {"hbm": 128, "host": 0.0, "shared": 0.0} and plain["evictions"] == 3
    assert tiered["hits_by_tier"] == {"hbm": 32, "host": 32, "shared": 64}
    # without counters the split is not known
    bare = report_from_replays(records, {"plain": replays["plain"]}, 32, B)
    assert bare["passes"]["plain"]["hits_by_tier"]["unknown"] == 128


def test_the_demo_report_splits_computed_before_misses_by_the_routers_records():
    records = [
        {"timestamp": i, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2, 3 + i], "user": "u"}
        for i in range(3)
    ]
    results = [
        RequestResult(i, "u", None, 96, 0, 4, 0.01, 0.02, f"r{i}", None, float(i), "out", f"q{i}") for i in range(3)
    ]
    replays = {"rr": ReplayReport(results, 1.0)}
    # the router placed q1 away from the replica holding the two shared blocks; it has no record of q2
    explained = {"rr": {"q1": {"elsewhere_blocks": 2, "tier_blocks": 0}}}
    rep = report_from_replays(records, replays, 32, B, explained=explained)
    by_id = {r["id"]: r["miss_tokens"] for r in rep["requests"]}
    assert by_id["req-1"] == {"misrouted": 64, "partial_block": 32}  # a prompt's last block is never served
    assert by_id["req-2"] == {"unknown": 64, "partial_block": 32}  # no record: evicted or misrouted, unknown


def test_the_counters_sum_what_every_engine_loaded_through_lmcache():
    from kvmesh.deployments.cachetest import counters_from_state

    state = {
        "router": {
            "index": {"evictions": 1},
            "routing_stats": {"r0": {"external_hit_tokens": 640}, "r1": {"external_hit_tokens": 32}, "r2": {}},
        },
        "tiers": {"host_hit_tokens": 900},
    }
    assert counters_from_state(state) == {"evictions": 1, "host_hit_tokens": 900, "external_hit_tokens": 672}
    del state["router"]["routing_stats"]  # engines that do not report it: no figure, not zero
    assert "external_hit_tokens" not in counters_from_state(state)

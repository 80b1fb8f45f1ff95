"""The cachetest runner's pure parts: partial-pass prompts and the demo's report from replayed runs."""

import pytest

from kvmesh.cluster.cachetest_analysis import Prepared
from kvmesh.cluster.cachetest_report import Rates
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


def _prepared(n=4):
    from kvmesh.cluster.prefix_share import hash_requests

    out = []
    for i in range(n):
        ids = list(range(100, 164)) + [900 + i] * 10
        req = LoggedRequest(f"r{i}", {"prompt": ids}, "/v1/completions", "a", f"c{i}")
        out.append(Prepared(req, TokenizedRequest(i, req.id, "a", None, ids)))
    hash_requests([p.tok for p in out], B)
    return out


@pytest.mark.parametrize(
    "sweep, passes, started, points",
    [
        ([1, 2, 4], ("cold", "warm"), [2, 1, 4], [1, 2, 4]),
        ([1, 2], ("cold", "warm"), [2, 1], [1, 2]),
        ([1, 2], ("cold", "warm", "partial"), [2, 1], [1, 2]),
        ([1, 4], ("cold", "warm"), [2, 1, 4], [1, 2, 4]),  # the main app's count is measured anyway
        ([1, 2], ("warm",), [2, 1, 2], [1, 2]),  # no cold pass before the main warm: 2 runs as the sweep's do
    ],
)
def test_the_replicas_sweep_has_the_main_apps_count_without_running_it_twice(
    monkeypatch, sweep, passes, started, points
):
    """--serve --replicas 2 --replicas-sweep ...: the sweep plotted [1, 4] for 1,2,4 and nothing for 1,2 (the
    main app's warm pass was not a sweep point); it is now, and its count starts no second app."""
    import kvmesh.deployments.app as app
    import kvmesh.deployments.cachetest_serve as cs
    from kvmesh.cluster.cachetest_analysis import Sent
    from kvmesh.cluster.cachetest_html import sweeps
    from kvmesh.cluster.cachetest_report import PassRun, build_report
    from kvmesh.cluster.prefix_share import offline_pass
    from kvmesh.deployments.cachetest import CachetestConfig

    apps: list[int] = []

    def start_local(cfg, timeout_s=600):
        apps.append(cfg["replicas"])
        return f"http://fake/{cfg['replicas']}"

    monkeypatch.setattr(app, "start_local", start_local)
    monkeypatch.setattr(app, "stop_local", lambda *a, **k: None)

    class FakeRunner:  # sends nothing: made-up answers
        def __init__(self, cfg, prepared, tok, progress=False):
            self.cfg, self.prepared, self.runs, self.clock = cfg, list(prepared), [], 0.0

        def send(self, name, items, c):
            hit = 0 if name.endswith("cold") else 64
            sent = [
                Sent(p, name, self.clock + i, self.clock + i + 0.1, p.tok.n, hit, "r0") for i, p in enumerate(items)
            ]
            self.clock += 10
            self.runs.append(PassRun(name, sent, 4.0, c))
            return self.runs[-1]

        def run_all(self):
            for name in ("cold", "warm"):
                if name in self.cfg.passes:
                    self.send(name, self.prepared, 4)

        def report(self, offline, meta=None):
            return build_report(self.runs, offline_pass([p.tok for p in self.prepared], B), Rates(), B)

    monkeypatch.setattr(cs, "Runner", FakeRunner)
    cfg = CachetestConfig(url="", passes=passes, concurrency=[4])
    rep = cs.serve_and_test(cfg, _prepared(), None, 2, sweep, False)
    assert apps == started
    assert [x for x, _ in sweeps(rep["passes"])["replicas"]] == points


def test_an_isolation_probe_that_measured_nothing_has_no_verdict(monkeypatch):
    """The probe's request timed out (or its answer had no cached-token count): that is no leak (ok=False,
    "Isolation probe: NO") but no verdict, with the error kept."""
    import kvmesh.deployments.cachetest as ct
    from kvmesh.cluster.prefix_share import hash_requests

    prepared = _prepared(2)
    prepared[1].req.tenant = prepared[1].tok.tenant = "b"
    prepared[1].tok.ids = list(range(300, 364)) + [901] * 10  # b computed none of a's blocks itself
    hash_requests([p.tok for p in prepared], B)
    runner = object.__new__(ct.Runner)
    runner.cfg = ct.CachetestConfig(url="http://x", tenant_keys={"a": "ka", "b": "kb"})
    runner.prepared, runner.served = prepared, "tiny"
    answers = {
        "timeout": RequestResult(0, "probe/b", "b", 74, None, 0, None, 30.0, "unknown", "ReadTimeout: timed out"),
        "no count": RequestResult(0, "probe/b", "b", 74, None, 1, 0.1, 0.2, "r0"),
        "leak": RequestResult(0, "probe/b", "b", 74, 64, 1, 0.1, 0.2, "r0"),
        "isolated": RequestResult(0, "probe/b", "b", 74, 0, 1, 0.1, 0.2, "r0"),
    }
    verdicts = {}
    for case, res in answers.items():
        monkeypatch.setattr(ct, "replay", lambda recs, cfg, res=res: ReplayReport([res], 1.0))
        iso = runner.isolation_probe()
        verdicts[case] = iso["ok"]
        assert iso["run"] and iso["as_tenant"] == "b" and iso["error"] == res.error
    assert verdicts == {"timeout": None, "no count": None, "leak": False, "isolated": True}


def _salted_replay(prepared, salted=True):
    """A replay of the probe against a server that cached every prepared prompt (as cold and warm did),
    per tenant (`salted`) or across tenants: whole blocks, never the last token."""
    cache = set()
    for p in prepared:
        for k in range(B, p.tok.n + 1, B):
            cache.add((p.req.tenant if salted else None, tuple(p.tok.ids[:k])))

    def replay(recs, cfg):
        rec = recs[0]
        ids = rec["body"]["prompt"]
        cached = 0
        for k in range(B, len(ids), B):
            if (rec["tenant"] if salted else None, tuple(ids[:k])) not in cache:
                break
            cached = k
        return ReplayReport([RequestResult(0, rec["user"], rec["tenant"], len(ids), cached, 1, 0.1, 0.2, "r0")], 1.0)

    return replay


def test_the_isolation_probe_counts_the_probers_own_cached_blocks_as_no_leak(monkeypatch):
    """Tenants a and b share a 64-token system prompt, each caching it under its own salt. The probe sent a's
    prompt as b and counted the 64 tokens b got from its own cache as a leak ("Isolation probe: NO")."""
    import kvmesh.deployments.cachetest as ct
    from kvmesh.cluster.prefix_share import hash_requests

    system = list(range(100, 164))
    prepared = []
    for i, tenant in enumerate("abab"):
        ids = system + [1000 + 50 * i + j for j in range(40)]  # 104 tokens: 2 shared blocks, 1 of its own
        req = LoggedRequest(f"r{i}", {"prompt": ids}, "/v1/completions", tenant, f"c{i}")
        prepared.append(Prepared(req, TokenizedRequest(i, req.id, tenant, None, ids)))
    hash_requests([p.tok for p in prepared], B)
    runner = object.__new__(ct.Runner)
    runner.cfg = ct.CachetestConfig(url="http://x", tenant_keys={"a": "ka", "b": "kb"}, block_size=B)
    runner.prepared, runner.served = prepared, "tiny"
    monkeypatch.setattr(ct, "replay", _salted_replay(prepared, salted=True))
    iso = runner.isolation_probe()
    assert iso["cached_tokens"] == 64 and iso["own_cached_tokens"] == 64 and iso["ok"] is True
    monkeypatch.setattr(ct, "replay", _salted_replay(prepared, salted=False))  # a cache shared across tenants
    iso = runner.isolation_probe()
    assert iso["cached_tokens"] == 96 and iso["ok"] is False


def test_an_unreadable_explain_record_leaves_that_request_unknown_not_the_test_dead(monkeypatch):
    """One transport error among the records (an ingress restarting, a timeout) ended the test with a
    traceback, losing every pass already sent."""
    import httpx

    import kvmesh.deployments.cachetest as ct

    def handler(request):
        if request.url.path.endswith("/q1"):
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"elsewhere_blocks": 1})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    cfg = ct.CachetestConfig(url="http://x", api_key="k")
    assert ct.fetch_explanations(cfg, ["q0", "q1", "q2"]) == {
        "q0": {"elsewhere_blocks": 1},
        "q2": {"elsewhere_blocks": 1},
    }


def test_the_concurrency_sweep_runs_before_the_partial_passes(monkeypatch):
    """The partial passes send new prompts that evict the logged ones: the first sweep point after them
    measured the eviction (88% hit, 3x TTFT at c8, back to 98% at c16), not the concurrency."""
    import kvmesh.deployments.cachetest as ct

    runner = object.__new__(ct.Runner)
    runner.cfg = ct.CachetestConfig(url="http://x", concurrency=[4, 8, 16])
    runner.prepared, runner.tokenizer = _prepared(), list(range(1024))  # len(): the vocabulary
    sent: list[str] = []
    monkeypatch.setattr(runner, "send", lambda name, items, c: sent.append(name), raising=False)
    monkeypatch.setattr(runner, "isolation_probe", lambda: {"run": False, "why": "test"}, raising=False)
    monkeypatch.setattr(ct, "reset_cache", lambda cfg: None)
    runner.run_all()
    assert sent == ["cold", "warm", "warm_c8", "warm_c16", "partial_boundary", "partial_midblock"]

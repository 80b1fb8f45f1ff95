"""report.json's document and report.html from sent requests: schema keys, exact sums, self-contained page."""

import json
import math

import cachetest_support
import pytest
from cachetest_support import sample_report

from kvmesh.cluster.cachetest_html import render_html, write_outputs
from kvmesh.cluster.cachetest_report import Rates

PASS_KEYS = {
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate_tokens",
    "hit_rate_requests",
    "requests_with_hit",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "input_cost",
    "cost_per_interaction",
    "hits_by_tier",
    "miss_tokens",
}
REQUEST_KEYS = {"id", "pass", "tenant", "prompt_tokens", "cached_tokens", "replica", "miss_tokens", "error", "ttft_s"}


def _report(server=False):
    return sample_report(server)


def test_every_request_and_pass_sums_exactly_and_has_the_schema_keys():
    rep = _report()
    for name, p in rep["passes"].items():
        assert PASS_KEYS <= set(p), name
        assert sum(p["miss_tokens"].values()) == p["counted_prompt_tokens"] - p["cached_tokens"]
    assert {r["pass"] for r in rep["requests"]} == {"cold", "warm"}
    for r in rep["requests"]:
        assert set(r) == REQUEST_KEYS
        if r["cached_tokens"] is not None:
            assert sum(r["miss_tokens"].values()) == r["prompt_tokens"] - r["cached_tokens"]
    cold = rep["passes"]["cold"]
    assert cold["cached_tokens"] == 0 and cold["errors"] > 0
    assert cold["input_cost"] == cold["prompt_tokens"] * 3.0 / 1e6
    assert rep["passes"]["warm"]["input_cost"] < cold["input_cost"]
    assert rep["summary"]["cost_change_vs_no_cache"] < 0 and rep["correctness"]["ok"] is True
    known = [r for r in rep["requests"] if r["pass"] == "warm" and r["cached_tokens"] is not None]
    warm = rep["passes"]["warm"]
    assert warm["hit_rate_requests"] == pytest.approx(
        sum(r["cached_tokens"] / r["prompt_tokens"] for r in known) / len(known)
    )
    assert warm["requests_with_hit"] == sum(r["cached_tokens"] > 0 for r in known) / len(known)
    assert warm["hit_rate_requests"] != warm["requests_with_hit"]  # a partial hit counts in part, not whole
    # a peer reports no tiers: the cached tokens are in an unknown tier, not guessed into hbm
    assert rep["passes"]["warm"]["hits_by_tier"]["unknown"] == rep["passes"]["warm"]["cached_tokens"]
    json.dumps(rep)  # serialisable


def test_tier_hits_and_evictions_come_from_the_server_counters():
    warm = _report(server=True)["passes"]["warm"]
    assert warm["evictions"] == 3
    tiers = warm["hits_by_tier"]
    assert tiers["host"] == 64 and tiers["hbm"] + tiers["host"] + tiers["shared"] == warm["cached_tokens"]


def test_the_page_is_self_contained_with_every_section(tmp_path):
    rep = _report()
    paths = write_outputs(rep, tmp_path)
    page = paths["html"].read_text()
    for section in ("summary", "passes", "sweeps", "tiers", "misses", "per_tenant", "per_replica", "drift"):
        assert f"id='{section}'" in page
    assert "<link" not in page and 'src="http' not in page and "src='http" not in page
    assert page.count("data:image/png;base64,") == 2  # passes and miss reasons (no sweep was run)
    assert json.loads(paths["json"].read_text())["passes"]["warm"]["requests"] == 60
    assert f"{100 * rep['summary']['hit_rate_tokens']:.1f}%" in render_html(rep, {})


def test_every_reason_with_missed_tokens_is_explained_and_no_other():
    from kvmesh.cluster.cachetest_html import REASON_TEXT
    from kvmesh.cluster.miss_reasons import REASONS

    assert set(REASON_TEXT) == set(REASONS)
    rep = _report()
    page = render_html(rep, {})
    legend = page.split("<dl class='reasons'>")[1].split("</dl>")[0]
    present = {r for p in rep["passes"].values() for r, v in p["miss_tokens"].items() if v}
    assert present  # the sample report has misses
    for r in REASONS:
        assert (f"<dt>{r}</dt>" in legend) == (r in present), r


def test_the_tier_split_counts_what_the_engines_loaded_not_what_lmcache_lookups_found():
    """LMCache's lookups also count tokens the engine held in its own cache: 900 host and 100 shared lookup
    hits, but the engines loaded only 300 tokens through LMCache. Of 1,000 cached tokens, 700 came from the
    engines' own caches, 100 from the shared tier (held nowhere else) and 200 from the host tier."""
    from kvmesh.cluster.cachetest_report import PassRun, Rates, pass_figures

    prepared, runs = cachetest_support.fake_runs(server=True)
    run = runs[-1]
    cached = sum(s.cached_tokens or 0 for s in run.sent if s.error is None)
    scale = 1000 / cached  # the same proportions at any sample size
    after = {
        "evictions": 0,
        "host_hit_tokens": round(900 / scale),
        "shared_hit_tokens": round(100 / scale),
        "external_hit_tokens": round(300 / scale),
    }
    fig = pass_figures(
        PassRun(run.name, run.sent, 1.0, 4, counters_before={"evictions": 0}, counters_after=after),
        [{} for _ in run.sent],
        Rates(),
    )
    tiers = fig["hits_by_tier"]
    assert tiers["shared"] == after["shared_hit_tokens"]
    assert tiers["host"] == after["external_hit_tokens"] - after["shared_hit_tokens"]
    assert tiers["hbm"] == cached - after["external_hit_tokens"]
    # without the engines' figure (an older server) the lookups stand in, capped at the cached tokens
    del after["external_hit_tokens"]
    fig = pass_figures(PassRun(run.name, run.sent, 1.0, 4, counters_after=after), [{} for _ in run.sent], Rates())
    assert fig["hits_by_tier"]["hbm"] == max(0, cached - after["host_hit_tokens"] - after["shared_hit_tokens"])


def test_spills_are_the_lmcache_chunk_counters_of_the_server_state_diffed_over_the_pass():
    """The node servers report chunks written to each tier (bytes only where a bytes-per-chunk is configured,
    else null): a pass's spills are the growth of the chunk counters that `/kvmesh/state` carries."""
    from kvmesh.cluster.cachetest_report import PassRun, Rates, pass_figures
    from kvmesh.deployments.cachetest import counters_from_state

    _, runs = cachetest_support.fake_runs(server=True)
    run = runs[-1]

    def state(to_host: int, to_shared: int) -> dict:
        tiers = {"chunks_to_host": to_host, "chunks_to_shared": to_shared, "bytes_to_host": None}
        return {"router": {"index": {"evictions": 0}}, "tiers": tiers}

    fig = pass_figures(
        PassRun(
            run.name,
            run.sent,
            1.0,
            4,
            counters_before=counters_from_state(state(10, 4)),
            counters_after=counters_from_state(state(35, 9)),
        ),
        [{} for _ in run.sent],
        Rates(),
    )
    assert fig["spills"] == {"to_host_chunks": 25, "to_shared_chunks": 5}


def test_evictions_read_from_two_routers_are_no_figure_of_the_pass():
    """With two ingress replicas the reads before and after a pass can reach different routers, each with
    its own index and eviction count (seen: -4880 for a pass): the pass then has no eviction figure."""
    from kvmesh.cluster.cachetest_report import PassRun, Rates, pass_figures
    from kvmesh.deployments.cachetest import counters_from_state

    _, runs = cachetest_support.fake_runs(server=True)
    run = runs[-1]

    def state(instance: str, evictions: int) -> dict:
        return {"router": {"instance": instance, "index": {"evictions": evictions}}, "tiers": {}}

    def evictions(before: dict, after: dict):
        counters = {"counters_before": counters_from_state(before), "counters_after": counters_from_state(after)}
        return pass_figures(PassRun(run.name, run.sent, 1.0, 4, **counters), [{} for _ in run.sent], Rates())[
            "evictions"
        ]

    assert evictions(state("a", 5000), state("a", 5120)) == 120
    assert evictions(state("a", 5000), state("b", 120)) is None


def _passes_report(passes, ids=lambda i: list(range(10, 107)) + [500 + i] * 3):
    """The report of four requests (`ids(i)`) sent in each of `passes`: (name, the cached tokens its k-th answer
    reports, or the error every answer of it fails with); outputs kept as the runner keeps them (answered)."""
    from kvmesh.cluster.cachetest_analysis import Prepared, Sent
    from kvmesh.cluster.cachetest_report import PassRun, Rates, build_report
    from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass
    from kvmesh.cluster.request_log import LoggedRequest

    block = 32
    prepared = []
    for i in range(4):
        req = LoggedRequest(f"r{i}", {"prompt": ids(i)}, "/v1/completions", "a", f"c{i}")
        prepared.append(Prepared(req, TokenizedRequest(i, req.id, "a", None, ids(i))))
    hash_requests([p.tok for p in prepared], block)
    runs, clock = [], 0.0
    for name, cached_of, err in passes:
        sent = []
        for k, p in enumerate(prepared):
            cached = None if err else cached_of(k)
            sent.append(Sent(p, name, clock, None if err else clock + 0.01, p.tok.n, cached, "r0", err))
            clock += 1
        outputs = {s.prepared.req.id: "out" for s in sent if s.error is None}
        runs.append(PassRun(name, sent, 1.0, 4, 0, {}, {}, outputs))
    return build_report(runs, offline_pass([p.tok for p in prepared], block), Rates(), block)


def _two_passes(warm_cached, warm_error=None):
    """Four 100-token requests (96 cacheable), cold then warm."""
    return _passes_report([("cold", lambda k: 0, None), ("warm", warm_cached, warm_error)])


def test_a_warm_pass_with_no_answer_has_no_hit_rate_and_no_correctness_verdict():
    rep = _two_passes(lambda k: 0, warm_error="HTTP 503: overloaded")
    warm = rep["passes"]["warm"]
    assert warm["errors"] == 4
    assert warm["hit_rate_tokens"] is None and warm["requests_with_hit"] is None
    assert rep["correctness"]["compared"] == 0 and rep["correctness"]["ok"] is None
    page = render_html(rep, {})
    assert "<b id='correct'>n/a</b>" in page and "<b id='hit-rate'>n/a</b>" in page


def test_answers_without_a_cached_count_are_outside_the_hit_rates_denominator_and_shown():
    rep = _two_passes(lambda k: 96 if k % 2 == 0 else None)  # two of four answers report no count
    warm = rep["passes"]["warm"]
    assert warm["prompt_tokens"] == 400 and warm["counted_prompt_tokens"] == 200
    assert warm["hit_rate_tokens"] == pytest.approx(192 / 200)
    assert sum(warm["miss_tokens"].values()) == warm["counted_prompt_tokens"] - warm["cached_tokens"]
    row = render_html(rep, {}).split("<tr><td>warm</td>")[1].split("</tr>")[0]
    assert row.startswith("<td>4</td><td>0</td><td>400</td><td>200</td><td>192</td><td>96.0%</td>"), row


def test_a_replicas_sweep_gets_its_own_plot_and_table_by_replica_count(tmp_path):
    """The replicas sweep's warm passes, by replica count, without the cold passes that only empty the cache."""
    names = ("replicas_1_cold", "replicas_1", "replicas_4_cold", "replicas_4", "replicas_2_cold", "replicas_2")
    passes = [(n, (lambda k: 0) if n.endswith("cold") else (lambda k: 64), None) for n in names]
    rep = _passes_report(passes, ids=lambda i: list(range(10, 80)) + [100 + i] * 20)
    paths = write_outputs(rep, tmp_path)
    assert (tmp_path / "sweep_replicas.png").exists() and not (tmp_path / "sweep_concurrency.png").exists()
    page = paths["html"].read_text()
    table = page.split("<h2 id='sweeps'>")[1].split("<h2")[0]
    assert "<th>engine replicas</th>" in table and "_cold" not in table
    names = [cell.split("</td>")[0] for cell in table.split("<tr><td>")[1:]]
    assert names == ["replicas_1", "replicas_2", "replicas_4"]


def _report_of(passes, n_tokens=lambda i: 100):
    """A report of requests r0.. (`n_tokens(i)` token prompts, one tenant, one interaction each) sent in each of
    `passes`: (name, per request (cached tokens, TTFT s, error)); a pass starts a fresh fleet where named so."""
    from kvmesh.cluster.cachetest_analysis import Prepared, Sent
    from kvmesh.cluster.cachetest_report import PassRun, Rates, build_report
    from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass
    from kvmesh.cluster.request_log import LoggedRequest

    block, count = 32, len(passes[0][1])
    prepared = []
    for i in range(count):
        ids = [1000 + 7 * i + k for k in range(n_tokens(i))]
        req = LoggedRequest(f"r{i}", {"prompt": ids}, "/v1/completions", "a", f"c{i}")
        prepared.append(Prepared(req, TokenizedRequest(i, req.id, "a", None, ids)))
    hash_requests([p.tok for p in prepared], block)
    runs, clock = [], 0.0
    for name, rows, *fresh in passes:
        sent = []
        for p, (cached, ttft, err) in zip(prepared, rows):
            ready = None if err or ttft is None else clock + ttft
            sent.append(Sent(p, name, clock, ready, p.tok.n, None if err else cached, "r0", err))
            clock += 10
        outputs = {s.prepared.req.id: "out" for s in sent if s.error is None}
        runs.append(PassRun(name, sent, 1.0, 4, 0, {}, {}, outputs, fresh_fleet=bool(fresh)))
    return build_report(runs, offline_pass([p.tok for p in prepared], block), Rates(3.0, 0.3), block)


def test_a_cold_only_test_compares_its_ttft_with_nothing():
    """--passes cold (or cold,partial): the summary's pass is cold, and cold against itself is no comparison."""
    rep = _report_of([("cold", [(0, 0.5, None), (64, 0.2, None), (64, 0.2, None)])])
    s = rep["summary"]
    assert s["pass"] == "cold" and s["hit_rate_tokens"] > 0
    assert s["ttft_change_vs_cold"] is None and s["ttft_compared_vs_cold"] is None
    assert "<b id='ttft-change'>n/a</b>" in render_html(rep, {})


def test_ttft_against_cold_compares_the_requests_answered_in_both():
    """Four short prompts and six long ones; the cache changes no request's TTFT, and four long ones time out
    in warm: warm's p50 over its survivors (mostly short) was -80% against cold's over all ten."""
    ttft = [0.2] * 4 + [1.0] * 6
    cold = [(0, t, None) for t in ttft]
    warm = [(0, t, "ReadTimeout" if 4 <= i < 8 else None) for i, t in enumerate(ttft)]
    s = _report_of([("cold", cold), ("warm", warm)], n_tokens=lambda i: 100 if i < 4 else 1500)["summary"]
    assert s["ttft_change_vs_cold"] == pytest.approx(0.0, abs=1e-9) and s["ttft_compared_vs_cold"] == 6
    page = render_html(_report_of([("cold", cold), ("warm", warm)]), {})
    assert "<small id='ttft-change-compared'>over 6 requests answered in both</small>" in page


def test_cost_and_ttft_against_round_robin_compare_the_requests_answered_in_both():
    """kvmesh: half its requests fail, the rest hit 32 of 100 tokens; round robin: every request hits 64.
    Over the total of whatever succeeded kvmesh looked 16% cheaper; request for request it costs 68% more."""
    kv = [(32, 0.1, "HTTP 503" if i % 2 else None) for i in range(10)]
    rr = [(64, 0.1 if i % 2 else 0.3, None) for i in range(10)]
    rep = _report_of([("kvmesh", kv, "fresh"), ("round_robin", rr, "fresh")])
    s = rep["summary"]
    both = Rates(3.0, 0.3)
    assert s["cost_change_vs_round_robin"] == pytest.approx(both.cost(100, 32) / both.cost(100, 64) - 1)
    assert s["cost_compared_vs_round_robin"] == 5 and s["ttft_compared_vs_round_robin"] == 5
    assert s["ttft_change_vs_round_robin"] == pytest.approx(0.1 / 0.3 - 1)  # round robin's answered ones: 0.3 s
    page = render_html(rep, {})
    assert "<small id='cost-vs-rr-compared'>over 5 requests answered in both</small>" in page


def test_the_low_value_warning_is_many_requests_hitting_while_the_cost_barely_moves():
    """Every request hits its one tiny 32-token block of 1,000: 100% of requests hit, the cost moves -3%."""
    cold = [(0, 0.5, None)] * 20
    s = _report_of([("cold", cold), ("warm", [(32, 0.5, None)] * 20)], n_tokens=lambda i: 1000)["summary"]
    assert s["requests_with_hit"] == 1.0 and s["cost_change_vs_no_cache"] > -0.05
    assert "too small" in s["warning"]
    # the blocks matter: no low-value warning (the only one: these unique prompts hit only because warm
    # re-sent them, above the infinite-cache bound)
    s = _report_of([("cold", cold), ("warm", [(992, 0.5, None)] * 20)], n_tokens=lambda i: 1000)["summary"]
    assert len(s["warnings"]) == 1 and "too small" not in s["warning"] and "upper bound" in s["warning"]


def test_answers_without_a_cached_count_get_their_own_warning_not_the_low_value_one():
    """One answer of twenty reported its (large) hit; the rest reported no count: their input is billed as
    uncached, so the cost barely moves, but not because the reused blocks are small."""
    warm = [(992 if i == 0 else None, 0.5, None) for i in range(20)]
    s = _report_of([("cold", [(0, 0.5, None)] * 20), ("warm", warm)], n_tokens=lambda i: 1000)["summary"]
    assert s["warning"].startswith("19 of 20 answers reported no cached-token count")
    assert "too small" not in s["warning"]


def test_nothing_measured_is_not_drawn_as_zero(tmp_path, monkeypatch):
    """Every warm request failed: no TTFT. The page says n/a; the plots drew a 0 ms bar and point."""
    from matplotlib.axes import Axes

    drawn: list[tuple[str, list]] = []
    bar, plot = Axes.bar, Axes.plot

    def record_bar(self, x, height, *a, **kw):
        drawn.append(("bar", list(height)))
        return bar(self, x, height, *a, **kw)

    def record_plot(self, *args, **kw):
        drawn.append(("plot", list(args[1])))
        return plot(self, *args, **kw)

    monkeypatch.setattr(Axes, "bar", record_bar)
    monkeypatch.setattr(Axes, "plot", record_plot)
    cold = [(0, 0.5, None)] * 4
    rep = _report_of([("cold", cold), ("warm", [(0, None, "HTTP 503")] * 4), ("warm_c8", cold)])
    write_outputs(rep, tmp_path)
    ttft_bars = drawn[1][1]  # hit rate bars, then TTFT p50 bars, then the p90 points
    assert ttft_bars[0] == 500.0 and math.isnan(ttft_bars[1]), drawn
    assert math.isnan(drawn[2][1][1])
    sweep = [values for kind, values in drawn[3:] if kind == "plot"][0]  # the concurrency sweep: warm, warm_c8
    assert math.isnan(sweep[0]) and sweep[1] == 500.0


def test_the_main_apps_warm_pass_is_the_replicas_sweeps_point_at_its_count():
    """--serve --replicas 2 --replicas-sweep 1,2: the main app ran cold and warm at 2 replicas, the sweep a
    fresh app at 1; the warm pass is the point at 2 (not run again), so there is a sweep of two points."""
    from kvmesh.cluster.cachetest_html import sweeps

    rows = [(0, 0.5, None)] * 4
    rep = _report_of([("cold", rows), ("warm", rows), ("replicas_1_cold", rows, "fresh"), ("replicas_1", rows)])
    assert sweeps(rep["passes"])["replicas"] == [(1, "replicas_1")]  # warm's replica count not recorded
    for name, n in (("cold", 2), ("warm", 2), ("replicas_1_cold", 1), ("replicas_1", 1)):
        rep["passes"][name]["replicas"] = n
    assert sweeps(rep["passes"])["replicas"] == [(1, "replicas_1"), (2, "warm")]
    assert "No sweep was run" not in render_html(rep, {})
    del rep["passes"]["cold"]  # a warm pass that followed no cold pass is not run as the sweep's are
    assert sweeps(rep["passes"])["replicas"] == [(1, "replicas_1")]


def test_an_isolation_probe_without_a_measurement_has_no_verdict_and_shows_why():
    from kvmesh.cluster.cachetest_report import summary

    rep = _report_of([("warm", [(0, 0.5, None)] * 2)])
    rep["isolation"] = {"run": True, "error": "ReadTimeout: timed out", "cached_tokens": None, "ok": None}
    rep["summary"] = summary(rep)
    page = render_html(rep, {})
    assert rep["summary"]["isolated"] is None and "<b id='isolation'>n/a</b>" in page
    assert "the probe&#x27;s request failed: ReadTimeout: timed out" in page


def _tenant_report(prompts, passes, meta=None):
    """A report of `prompts` ((tenant, interaction, token ids) per request) sent in each of `passes`: (name,
    answer(i) -> (cached tokens, error, the server's prompt token count or None for the client's))."""
    from kvmesh.cluster.cachetest_analysis import Prepared, Sent
    from kvmesh.cluster.cachetest_report import PassRun, Rates, build_report
    from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass
    from kvmesh.cluster.request_log import LoggedRequest

    prepared = []
    for i, (tenant, interaction, ids) in enumerate(prompts):
        req = LoggedRequest(f"r{i}", {"prompt": ids}, "/v1/completions", tenant, interaction)
        prepared.append(Prepared(req, TokenizedRequest(i, req.id, tenant, None, ids)))
    hash_requests([p.tok for p in prepared], 32)
    runs, clock = [], 0.0
    for name, answer in passes:
        sent = []
        for i, p in enumerate(prepared):
            cached, err, counted = answer(i)
            n = p.tok.n if counted is None else counted
            sent.append(Sent(p, name, clock, None if err else clock + 0.1, n, None if err else cached, "r0", err))
            clock += 1
        runs.append(PassRun(name, sent, 1.0, 4, 0, {}, {}, {s.prepared.req.id: "o" for s in sent if not s.error}))
    offline = offline_pass([p.tok for p in prepared], 32)
    return build_report(runs, offline, Rates(3.0, 0.3), 32, meta=meta)


def test_a_warm_pass_above_the_infinite_cache_bound_is_labelled_re_sent_traffic():
    """Unique prompts: no cache can reuse anything on first contact (bound 0%), yet warm, which re-sends the
    log straight after cold, hit 99% and showed -89% cost with no warning. It is flagged as an upper bound,
    and the cold pass's first-contact hit rate stands beside the bound."""
    cold = [(0, 0.5, None)] * 8
    rep = _report_of([("cold", cold), ("warm", [(992, 0.1, None)] * 8)], n_tokens=lambda i: 1000)
    s = rep["summary"]
    assert rep["offline"]["infinite_cache"]["hit_rate"] == 0.0 and s["hit_rate_tokens"] > 0.99
    assert "above the 0.0% an infinite cache reaches" in s["warning"] and "upper bound" in s["warning"]
    assert s["cold_hit_rate_tokens"] == 0.0 and s["main_resent"] is True
    page = render_html(rep, {})
    assert "<b id='cold-hit-rate'>0.0%</b>" in page
    assert "<small id='hit-rate-compared'>warm pass: the log re-sent, an upper bound</small>" in page
    assert "<small id='cost-change-compared'>warm pass: the log re-sent, an upper bound</small>" in page
    assert "<p class='warn'>the warm pass hit 99.2%" in page
    # within the bound (a warm pass that reuses no more than first contact could): no such warning
    rep = _report_of([("cold", cold), ("warm", [(0, 0.1, None)] * 8)], n_tokens=lambda i: 1000)
    assert "an infinite cache reaches" not in rep["summary"].get("warning", "")


def test_a_cold_pass_above_the_bound_without_a_reset_is_flagged_and_the_reset_is_shown():
    """The server kept an earlier run's cache (no reset endpoint): cold hit 99% of unique prompts, so every
    comparison against cold (TTFT -0%) compared warm with warm, silently."""
    from kvmesh.cluster.cachetest_report import summary

    rows = [(992, 0.1, None)] * 8
    rep = _report_of([("cold", rows), ("warm", rows)], n_tokens=lambda i: 1000)
    rep["meta"]["cold_reset"] = None
    rep["summary"] = summary(rep)
    assert "the cold pass hit 99.2%" in rep["summary"]["warning"]
    assert "not reset" in rep["summary"]["warning"]
    assert "cache reset before cold: <span id='cold-reset'>none" in render_html(rep, {})
    rep["meta"]["cold_reset"] = "/reset_prefix_cache"  # reset: the cold pass was first contact as far as known
    rep["summary"] = summary(rep)
    assert "not reset" not in rep["summary"]["warning"]
    assert "<span id='cold-reset'>/reset_prefix_cache</span>" in render_html(rep, {})


def test_interactions_are_per_tenant_and_only_completed_ones_are_costed():
    """Two tenants each have interactions c0 and c1 (four interactions); b's c1 has a failed turn. Keyed by
    interaction id alone they were two, one completed; the failed interaction's answered turn was in the
    numerator too."""
    from kvmesh.cluster.cachetest_report import Rates

    prompts = [
        (t, c, [1000 + 100 * k + j for j in range(100)])
        for k, (t, c) in enumerate([("a", "c0"), ("a", "c1"), ("b", "c0"), ("b", "c1"), ("b", "c1")])
    ]
    rep = _tenant_report(prompts, [("cold", lambda i: (0, "HTTP 500" if i == 4 else None, None))])
    cold = rep["passes"]["cold"]
    assert cold["completed_interactions"] == 3
    assert cold["cost_per_interaction"] == pytest.approx(Rates(3.0, 0.3).cost(100, 0))
    assert cold["input_cost"] == pytest.approx(4 * Rates(3.0, 0.3).cost(100, 0))  # every answer is billed


def test_a_tenant_whose_requests_all_failed_keeps_its_row_and_many_errors_warn():
    """Tenant b's five requests all failed: its row vanished from the per-tenant table (rows were over the
    answers), and half the pass failing gave no warning."""
    prompts = [("ab"[i % 2], f"c{i}", [2000 + 100 * i + j for j in range(100)]) for i in range(10)]
    rep = _tenant_report(
        prompts,
        [("cold", lambda i: (0, None, None)), ("warm", lambda i: (96, "HTTP 503" if i % 2 else None, None))],
    )
    tenants = rep["passes"]["warm"]["per_tenant"]
    assert tenants["b"]["requests"] == 5 and tenants["b"]["errors"] == 5 and tenants["b"]["hit_rate_tokens"] is None
    assert tenants["a"]["requests"] == 5 and tenants["a"]["errors"] == 0 and tenants["a"]["prompt_tokens"] == 500
    assert "5 of 10 requests of warm failed" in rep["summary"]["warning"]
    page = render_html(rep, {})
    table = page.split("<h2 id='per_tenant'>")[1].split("</table>")[0]
    assert "<th>errors</th>" in table and "<tr><td>b</td><td>5</td><td>5</td><td>0</td><td>0</td><td>n/a</td>" in table
    # one failure in ten is no warning
    rep = _tenant_report(prompts, [("cold", lambda i: (0, "HTTP 503" if i == 0 else None, None))])
    assert "failed" not in rep["summary"].get("warning", "")


def test_server_token_counts_unlike_the_clients_warn_to_pass_the_tokenizer():
    """The server tokenises with another model (twice the tokens): the offline bound, hashes and miss reasons
    describe other token ids than those measured, silently."""
    prompts = [("a", f"c{i}", [3000 + 100 * i + j for j in range(100)]) for i in range(6)]
    rep = _tenant_report(prompts, [("cold", lambda i: (0, None, 200))])
    assert rep["token_counts"] == {
        "compared": 6,
        "differing": 6,
        "client_prompt_tokens": 600,
        "server_prompt_tokens": 1200,
    }
    assert "pass --tokenizer" in rep["summary"]["warning"]
    # a token or two apart (within 3%) on most prompts: no warning
    rep = _tenant_report(prompts, [("cold", lambda i: (0, None, 102))])
    assert rep["token_counts"]["differing"] == 0 and "--tokenizer" not in rep["summary"].get("warning", "")


def test_outputs_are_written_whole_and_an_earlier_runs_sweep_plot_is_removed(tmp_path):
    """A report that cannot be serialised (or an interrupt) cut report.json short; a sweep plot from an
    earlier run stayed beside a report without a sweep."""
    rep = _report()
    (tmp_path / "report.json").write_text('{"earlier": true}')
    (tmp_path / "sweep_concurrency.png").write_bytes(b"old")
    bad = dict(rep, extra=object())
    with pytest.raises(TypeError):
        write_outputs(bad, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == {"earlier": True}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    write_outputs(rep, tmp_path)
    assert not (tmp_path / "sweep_concurrency.png").exists()
    assert json.loads((tmp_path / "report.json").read_text())["passes"]["warm"]["requests"] == 60

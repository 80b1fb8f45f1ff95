"""report.json's document and report.html from sent requests: schema keys, exact sums, self-contained page."""

import json

import cachetest_support
import pytest
from cachetest_support import sample_report

from kvmesh.cluster.cachetest_html import render_html, write_outputs

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
REQUEST_KEYS = {"id", "pass", "tenant", "prompt_tokens", "cached_tokens", "replica", "miss_tokens"}


def _report(server=False):
    return sample_report(server)


def test_every_request_and_pass_sums_exactly_and_has_the_schema_keys():
    rep = _report()
    for name, p in rep["passes"].items():
        assert PASS_KEYS <= set(p), name
        assert sum(p["miss_tokens"].values()) == p["prompt_tokens"] - p["cached_tokens"]
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

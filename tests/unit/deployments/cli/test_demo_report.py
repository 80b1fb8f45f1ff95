"""`kvmesh demo`'s text report (deployments/cli/demo.py `_report`) on crafted runs: figures compared over the
same requests, the bounds' labels, failed requests, tiers, the prediction line; and the figures it takes
from the replay client and the cachetest report."""

from __future__ import annotations

import argparse

from kvmesh.cluster.bounds import record_bounds
from kvmesh.deployments.cachetest import report_from_replays
from kvmesh.deployments.cli import demo
from kvmesh.deployments.replay import ReplayReport, RequestResult, format_table

BOUNDS = {"infinite": {"hit_rate": 0.6}, "round_robin_infinite": {"hit_rate": 0.5}}


def _args(**kw):
    return argparse.Namespace(**{"replicas": 2, "tiers": False, **kw})


def _res(i, prompt, cached, ttft, replica="r0", error=None):
    if error:
        return RequestResult(i, "u", None, prompt, None, 0, None, 0.5, replica, error, float(i))
    return RequestResult(i, "u", None, prompt, cached, 4, ttft, ttft + 0.01, replica, None, float(i), "x", f"q{i}")


def _report(capsys, results, args=None, replays=None) -> str:
    capsys.readouterr()
    if replays is None:
        demo._report(args or _args(), list(results), results, BOUNDS, True)
    else:
        demo._report(args or _args(), list(results), results, BOUNDS, True, replays)
    return capsys.readouterr().out


def _failed_runs():
    """kvmesh lost its first (long, uncached) request; round robin answered all four."""
    kv = [
        _res(0, 1000, None, None, error="HTTP 500: boom"),
        _res(1, 100, 50, 0.02),
        _res(2, 100, 50, 0.02),
        _res(3, 100, 50, 0.02),
    ]
    rr = [_res(0, 1000, 0, 0.5), _res(1, 100, 0, 0.04), _res(2, 100, 0, 0.04), _res(3, 100, 0, 0.04)]
    return {"kvmesh": ReplayReport(kv, 1.0), "round_robin": ReplayReport(rr, 1.0)}


def test_kvmesh_and_round_robin_are_compared_over_the_requests_answered_in_both(capsys):
    replays = _failed_runs()
    # the per-request rows kept in the results (--json) pair the runs as the replays themselves do
    for results, reps in (
        ({n: r.to_json(per_request=True) for n, r in replays.items()}, None),
        ({n: r.to_json() for n, r in replays.items()}, replays),
    ):
        out = _report(capsys, results, replays=reps)
        # over requests 1-3: 150 uncached against 300, TTFT p50 20 ms against 40 ms (the whole runs: 150 / 1300)
        assert "kvmesh computes 0.50x the prompt tokens round robin computes, over 3 requests answered in both" in out
        assert "kvmesh p50 TTFT is 0.50x round robin's, over 3 requests answered in both" in out
        assert "0.12x" not in out


def test_runs_with_failures_and_no_per_request_rows_are_not_compared_on_different_requests(capsys):
    results = {n: r.to_json() for n, r in _failed_runs().items()}
    out = _report(capsys, results)
    assert "kvmesh computes" not in out and "p50 TTFT is" not in out
    assert "not compared" in out


def test_runs_without_failures_compare_their_own_figures(capsys):
    a = {"requests": 4, "errors": 0, "uncached_prompt_tokens": 100, "ttft_p50_s": 0.01, "hit_rate_tokens": 0.5}
    b = {"requests": 4, "errors": 0, "uncached_prompt_tokens": 200, "ttft_p50_s": 0.04, "hit_rate_tokens": 0.3}
    out = _report(capsys, {"kvmesh": a, "round_robin": b})
    assert "kvmesh computes 0.50x the prompt tokens round robin computes, over 4 requests answered in both" in out
    assert "kvmesh p50 TTFT is 0.25x round robin's, over 4 requests answered in both" in out


def test_a_run_with_failed_requests_gets_no_cache_leak_warning_and_is_named_partial(capsys):
    run = {"requests": 71, "errors": 10, "hit_rate_tokens": 0.73, "cached_tokens": 100}
    out = _report(capsys, {"kvmesh": run})
    assert "WARNING" not in out
    assert "kvmesh: 10 of 71 requests failed: its figures are partial" in out
    clean = {"requests": 71, "errors": 0, "hit_rate_tokens": 0.73, "cached_tokens": 100}
    assert "WARNING: kvmesh hit more than an infinite cache could" in _report(capsys, {"kvmesh": clean})


def test_the_balance_figure_counts_replicas_that_answered_nothing():
    res = [_res(i, 1000, 500 if i else 0, 0.01) for i in range(10)]  # all on r0 of a 2-replica fleet
    rep = ReplayReport(res, 1.0)
    assert rep.summary()["uncached_max_over_mean"] == 1.0  # fleet not known: over the replicas that answered
    by_count = rep.to_json(replicas=2)
    assert by_count["uncached_max_over_mean"] == 2.0 and by_count["idle_replicas"] == 1
    assert "answered no request" in format_table({"kvmesh": by_count})
    by_ids = rep.summary(["r0", "r1"])
    assert by_ids["uncached_max_over_mean"] == 2.0 and by_ids["per_replica"]["r1"]["requests"] == 0
    assert "r1: 0 req" in format_table({"kvmesh": by_ids})
    labelled = ReplayReport([_res(0, 100, 0, 0.01, replica="peer")], 1.0, label="peer").summary(2)
    assert labelled["uncached_max_over_mean"] == 1.0 and "idle_replicas" not in labelled  # no replica ids: no padding


def test_a_tiered_run_without_a_tier_report_says_unknown_not_no_tier(capsys):
    for server, why in (
        ({"error": "GET /kvmesh/state failed: ReadTimeout"}, "ReadTimeout"),
        ({"counters": {}, "prediction": {}, "tiers": None}, "no tier report"),
    ):
        run = {"requests": 71, "errors": 0, "hit_rate_tokens": 0.5, "cached_tokens": 35008, "server": server}
        out = _report(capsys, {"kvmesh+tiers": run})
        line = next(x for x in out.splitlines() if "hits by tier" in x)
        assert "no host/shared tier" not in line
        assert "unknown (state unavailable: " in line and why in line
    plain = {"requests": 71, "errors": 0, "hit_rate_tokens": 0.5, "cached_tokens": 35008, "server": {}}
    assert "no host/shared tier in this run" in _report(capsys, {"kvmesh": plain})


def test_the_prediction_line_says_a_mismatch_is_a_block_or_more(capsys):
    pred = {"compared": 71, "mismatches": 0, "alarm": False, "predicted_tokens": 20448, "delivered_tokens": 22649}
    run = {"requests": 71, "errors": 0, "hit_rate_tokens": 0.5, "cached_tokens": 1, "server": {"prediction": pred}}
    out = _report(capsys, {"kvmesh": run})
    assert f"0 of 71 requests differ by a block ({demo.ENGINE_BLOCK} tokens) or more" in out


def test_round_robin_over_infinite_caches_is_a_reference_not_a_bound(capsys):
    out = _report(capsys, {"kvmesh": {"requests": 1, "errors": 0}})
    lines = out.splitlines()
    ref = next(x for x in lines if "round robin over 2 infinite caches" in x)
    assert ref.startswith("reference, not a bound") and "record order 50.0%" in ref
    bound = next(x for x in lines if "infinite cache 60.0%" in x)
    assert bound.startswith("bound ") and "round robin" not in bound


def test_the_html_infinite_cache_bound_is_the_order_free_one_the_text_prints():
    """B (96 tokens) then A (its first 64, ending on a block boundary): in record order B stores and A cannot
    hit its own last block; answered A first, B hits both blocks A stored. The bound holds in every order."""
    recs = [
        {"timestamp": 0, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 3], "user": "b"},
        {"timestamp": 1, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "user": "a"},
    ]
    res = [_res(0, 96, 64, 0.01), _res(1, 64, 0, 0.01)]
    rep = report_from_replays(recs, {"kvmesh": ReplayReport(res, 1.0)}, 32, 32)
    text_bound = record_bounds(recs, 32, 32, replicas=2)["infinite"]["hit_rate"]
    assert rep["offline"]["infinite_cache"]["hit_rate"] == text_bound == 0.4
    assert rep["summary"]["offline_infinite_hit_rate"] >= rep["summary"]["hit_rate_tokens"]


def test_the_workload_line_counts_the_conversations_chosen():
    recs = [{"user": u} for u in ("a", "a", "b")]
    assert demo._conversations(_args(conversations=2), recs) == "2 conversations"
    assert demo._conversations(_args(conversations=100_000), recs) == (
        "2 conversations (asked for 100,000: no more of the trace fit)"
    )


def test_the_demo_cachetest_report_records_the_concurrency_used():
    recs = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "user": "a"}]
    rep = report_from_replays(recs, {"kvmesh": ReplayReport([_res(0, 64, 0, 0.01)], 1.0, concurrency=4)}, 32, 32)
    assert rep["passes"]["kvmesh"]["concurrency"] == 4


def test_a_live_demo_whose_app_cannot_start_says_so_in_one_line_exit_2(monkeypatch, capsys):
    """The demo let start_local's error escape: a traceback and exit status 1, where `kvmesh serve` prints one
    line and exits 2 (the CLI's contract for an error the user can act on)."""
    from kvmesh.deployments import app, process_tree
    from kvmesh.deployments.cli import main

    def failing_start(config, **kw):
        raise RuntimeError(
            "Deploying application kvmesh failed: \x1b[36mray::ServeReplica.init()\x1b[39m died.\nTraceback: ..."
        )

    stopped = []
    monkeypatch.setattr(app, "start_local", failing_start)
    monkeypatch.setattr(app, "stop_local", lambda *a, **k: stopped.append(1))
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: True)  # not this test process
    argv = ["demo", "--live", "--replicas", "1", "--conversations", "2", "--policies", "kvmesh"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert err == [
        "error: kvmesh demo: kvmesh: could not start the app: Deploying application kvmesh failed: "
        "ray::ServeReplica.init() died."
    ]
    assert stopped, "the demo did not stop what the failed start left"


def test_the_live_demo_keeps_what_rays_processes_orphan_below_itself(monkeypatch):
    """The demo runs Ray in its own process without `kvmesh serve`'s relay: as a child subreaper it inherits
    what Ray's processes orphan, so each run's stop ends it (`stop_local` ends every process below)."""
    from kvmesh.deployments import app, process_tree
    from kvmesh.deployments.cli import main

    calls = []

    def failing_start(config, **kw):
        calls.append("start")
        raise RuntimeError("not started in a unit test")

    monkeypatch.setattr(app, "start_local", failing_start)
    monkeypatch.setattr(app, "stop_local", lambda *a, **k: None)
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: calls.append("subreaper") or True)
    assert main(["demo", "--live", "--replicas", "1", "--conversations", "2", "--policies", "kvmesh"]) == 2
    assert calls == ["subreaper", "start"]

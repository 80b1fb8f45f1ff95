"""The live scale-out bench's verdicts, on made-up rows: a synced multi-ingress run is judged against its
workload's single-ingress run (hit within 0.01, prefill max/mean within 1.25), the no-sync contrast is
reported but not judged, and a replica that got nothing counts in the balance."""

from __future__ import annotations

from kvmesh.benchmarks.bench_scale_live import checks, prefill_max_over_mean


def _row(workload, ingress, sync, hit, mom, errors=0):
    return {
        "workload": workload,
        "ingress": ingress,
        "sync": sync,
        "hit": hit,
        "prefill_max_over_mean": mom,
        "errors": errors,
    }


def test_a_replica_that_got_nothing_counts_as_zero():
    per = {"a": {"uncached_prompt_tokens": 300}, "b": {"uncached_prompt_tokens": 100}}
    assert prefill_max_over_mean(per, 4) == 300 / 100  # mean over 4 replicas: 100
    assert prefill_max_over_mean({}, 4) == 1.0


def test_synced_runs_are_judged_against_the_single_ingress_run():
    rows = [
        _row("chat", 1, True, 0.80, 1.10),
        _row("chat", 2, True, 0.795, 1.20),  # within 0.01, balanced: met
        _row("chat", 4, True, 0.78, 1.10),  # 0.02 below: missed
        _row("chat", 2, False, 0.50, 3.0),  # the contrast: not judged
        _row("moon", 2, True, 0.90, 1.30),  # no baseline, and too unbalanced
    ]
    verdict = dict(checks(rows))
    assert verdict["chat ingress=2 sync=on: hit >= single-ingress hit - 0.01"]
    assert verdict["chat ingress=2 sync=on: prefill max/mean <= 1.25"]
    assert not verdict["chat ingress=4 sync=on: hit >= single-ingress hit - 0.01"]
    assert not any("sync=off" in name for name in verdict)
    assert not verdict["moon ingress=2 sync=on: hit >= single-ingress hit - 0.01"]
    assert not verdict["moon ingress=2 sync=on: prefill max/mean <= 1.25"]
    assert all(verdict[f"chat ingress={n} sync=on: no failed request"] for n in (1, 2, 4))


def test_a_run_with_failed_requests_misses():
    verdict = dict(checks([_row("chat", 1, True, 0.8, 1.0, errors=2), _row("chat", 2, True, 0.8, 1.0)]))
    assert verdict["chat ingress=1 sync=on: no failed request"] is False
    assert verdict["chat ingress=2 sync=on: no failed request"] is True


def test_a_workload_without_a_synced_multi_ingress_run_misses():
    """Only the single-ingress baseline (or only the unsynced contrast) measured: the targets went unjudged."""
    verdict = dict(checks([_row("chat", 1, True, 0.8, 1.0), _row("chat", 2, False, 0.8, 1.0)]))
    assert verdict["chat: a synced multi-ingress run measured"] is False
    assert verdict["chat ingress=1 sync=on: no failed request"] is True


def _summary(hit, per):
    return {
        "requests": sum(r["requests"] for r in per.values()),
        "errors": 0,
        "hit_rate_tokens": hit,
        "ttft_p50_s": 0.1,
        "per_replica": per,
    }


def test_repetitions_are_averaged_and_each_kept():
    from kvmesh.benchmarks.bench_scale_live import summarize

    even = {k: {"requests": 2, "uncached_prompt_tokens": 100} for k in "abcd"}
    skew = {"a": {"requests": 5, "uncached_prompt_tokens": 200}, "b": {"requests": 3, "uncached_prompt_tokens": 200}}
    row = summarize([_summary(0.7, even), _summary(0.8, skew)], 2, True, 30.0, [])
    assert row["hits"] == [0.7, 0.8] and abs(row["hit"] - 0.75) < 1e-12
    assert row["prefill_max_over_mean_each"] == [1.0, 2.0]  # skew: 200 against a mean of 100 over 4
    # the run's balance is the summed work's: a 300 / 300 / 100 / 100 fleet, mean 200
    assert row["prefill_max_over_mean"] == 1.5
    assert row["per_replica_prefill"] == [300, 300, 100, 100]
    assert row["per_replica_requests"] == [7, 5, 2, 2] and row["requests"] == 16
    # a repetition without a hit rate (no usage reported) leaves the row without one: a miss, not a guess
    assert summarize([_summary(None, even), _summary(0.8, even)], 2, True, 30.0, [])["hit"] is None

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
    verdict = dict(checks([_row("chat", 1, True, 0.8, 1.0, errors=2)]))
    assert verdict == {"chat ingress=1 sync=on: no failed request": False}

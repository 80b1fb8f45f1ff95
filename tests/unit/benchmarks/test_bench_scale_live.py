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


def _fake_run_one(fail_at: int):
    """run_one measuring a row per call and raising on call `fail_at` (a start-up that timed out)."""
    calls = []

    def run_one(records, ingress, sync, repeats):
        calls.append(ingress)
        if len(calls) == fail_at:
            raise TimeoutError("app did not start (fake)")
        return {
            "ingress": ingress,
            "sync": sync,
            "errors": 0,
            "hit": 0.75,
            "ttft_p50_s": 0.05,
            "prefill_max_over_mean": 1.05,
            "per_replica_requests": [],
            "routers": [],
        }

    return run_one


def test_the_rows_measured_before_a_failing_setup_are_on_disk(monkeypatch, tmp_path):
    """The JSON was written only after the last setup: a setup that failed lost every earlier row. Now each
    setup rewrites it, marked incomplete, and the failure still ends the bench with an error."""
    import json

    import pytest

    from kvmesh.benchmarks import bench_scale_live as sl

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setenv("BENCH_SCALE_LIVE_WORKLOADS", "chat")
    monkeypatch.setattr(sl, "workloads", lambda names: {n: [] for n in names})
    monkeypatch.setattr(sl, "run_one", _fake_run_one(fail_at=3))
    with pytest.raises(TimeoutError):
        sl.main()
    report = json.loads((tmp_path / "scale_live" / "scale_live.json").read_text())
    assert report["complete"] is False
    assert [(r["ingress"], r["sync"]) for r in report["rows"]] == [(1, True), (2, True)]
    assert not list((tmp_path / "scale_live").glob("*.tmp"))

    monkeypatch.setattr(sl, "run_one", _fake_run_one(fail_at=0))
    monkeypatch.setattr(sl, "plot", lambda rows, path: None)
    sl.main()  # every target met: no SystemExit
    report = json.loads((tmp_path / "scale_live" / "scale_live.json").read_text())
    assert report["complete"] is True and len(report["rows"]) == len(sl.SETUPS)


def test_the_plot_labels_its_axes_marks_the_hit_target_and_shows_a_missing_hit_as_missing(monkeypatch):
    """The hit panel had no y label, no legend and no target line, and a run without a hit rate was a 0.0 bar."""
    from kvmesh.benchmarks import bench_scale_live as sl

    figures = []
    monkeypatch.setattr(sl, "save_plot", lambda fig, path: figures.append(fig))
    rows = [
        _row("chat", 1, True, 0.749, 1.07),
        _row("chat", 2, True, 0.70, 1.02),
        _row("chat", 4, True, None, 1.11),  # no hit rate reported
        _row("chat", 2, False, 0.733, 1.15),
    ]
    sl.plot(rows, "unused.png")
    hit_ax, balance_ax = figures[0].axes
    for ax in (hit_ax, balance_ax):
        assert ax.get_ylabel() and ax.get_legend() is not None
    targets = [line.get_ydata()[0] for line in hit_ax.lines]
    assert len(targets) == 1 and abs(targets[0] - (0.749 - sl.HIT_SLACK)) < 1e-9
    filled = sorted(round(p.get_height(), 3) for p in hit_ax.patches if p.get_fill())
    assert filled == [0.7, 0.733, 0.749]  # no 0.0 bar for the run without a hit rate
    assert [t.get_text() for t in hit_ax.texts] == ["n/a"]
    import matplotlib.pyplot as plt

    plt.close(figures[0])

"""bench_live's targets: it passes and misses on the figures it is given."""

from __future__ import annotations

import pytest

from kvmesh.cluster import workloads as wl

CHAT = wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, system_blocks=6, seed=11)


def test_bench_live_targets_pass_and_miss():
    from kvmesh.benchmarks.bench_live import evaluate

    def summary(uncached, hit, p50, errors=0):
        return {"uncached_prompt_tokens": uncached, "hit_rate_tokens": hit, "ttft_p50_s": p50, "errors": errors}

    good = evaluate({"kvmesh": summary(50, 0.7, 0.07), "round_robin": summary(100, 0.4, 0.1)}, bound_hit_rate=0.75)
    assert [ok for *_, ok in good] == [True, True, True, True]
    assert good[0][1] == pytest.approx(0.5) and good[1][1] == pytest.approx(0.7 / 0.75)
    bad = evaluate({"kvmesh": summary(70, 0.6, None, errors=1), "round_robin": summary(100, 0.4, 0.1)}, 0.75)
    assert [ok for *_, ok in bad] == [False, False, False, False]  # a missing TTFT is a miss, not a pass


def test_the_first_policys_results_survive_a_failing_second_run(monkeypatch, tmp_path):
    """The JSON was written only after both runs: a round-robin run that failed lost kvmesh's results. Now
    each run rewrites it, marked incomplete, and the failure still ends the bench with an error."""
    import json

    import kvmesh.deployments.app as app
    import kvmesh.deployments.replay as rp
    from kvmesh.benchmarks import bench_live

    starts = []

    def start_local(config):
        starts.append(config["policy"])
        if config["policy"] == "round_robin":
            raise TimeoutError("app did not start (fake)")
        return "http://127.0.0.1:9"

    class Report:
        def to_json(self, per_request=False):
            return {"hit_rate_tokens": 0.7, "errors": 0}

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(app, "start_local", start_local)
    monkeypatch.setattr(app, "stop_local", lambda: None)
    monkeypatch.setattr(rp, "replay", lambda records, cfg: Report())
    with pytest.raises(TimeoutError):
        bench_live.main()
    report = json.loads((tmp_path / "live" / "bench_live.json").read_text())
    assert starts == ["kvmesh", "round_robin"]
    assert report["complete"] is False and list(report["results"]) == ["kvmesh"]
    assert not list((tmp_path / "live").glob("*.tmp"))


def test_the_plot_shows_a_missing_figure_as_missing_not_as_zero(monkeypatch, tmp_path):
    """A run without a TTFT (nothing answered) was drawn as a 0 ms bar: the best TTFT on the chart."""
    import matplotlib.figure

    from kvmesh.benchmarks import bench_live

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))

    def summary(uncached, hit, p50):
        return {"uncached_prompt_tokens": uncached, "hit_rate_tokens": hit, "ttft_p50_s": p50, "ttft_p90_s": p50}

    bounds = {"infinite": {"hit_rate": 0.8}, "round_robin_infinite": {"hit_rate": 0.5, "replicas": 4}}
    bench_live.plot(
        {"kvmesh": summary(50, 0.7, None), "round_robin": summary(100, 0.4, 0.1)}, bounds, str(tmp_path / "p.png")
    )
    ttft = figures[0].axes[2]
    assert sorted(round(p.get_height(), 3) for p in ttft.patches if p.get_fill()) == [100.0, 100.0]
    assert [t.get_text() for t in ttft.texts] == ["n/a", "n/a"]

"""The robustness bench: its TTFT tail lines (one per policy but the baseline, from `sweep.ttft_against`) and the
live rows saved apart from their decision traces."""

from __future__ import annotations

from kvmesh.benchmarks.bench_robust import print_tails
from kvmesh.cluster.sweep import ttft_against


def _row(seed, kv_p50, kv_p90):
    tier = {
        "round_robin": {"ttft_p50_s": 0.1, "ttft_p90_s": 0.2},
        "kvmesh": {"ttft_p50_s": kv_p50, "ttft_p90_s": kv_p90},
    }
    return {"seed": seed, "shared_tier": tier}


def test_tail_lines_compare_each_policy_with_round_robin_and_count_draws_over_1_1(capsys):
    rows = [_row(1, 0.09, 0.2), _row(2, 0.1, 0.3), _row(3, 0.12, 0.18)]
    print_tails(ttft_against(rows, "round_robin", "shared_tier"))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "kvmesh" in lines[0] and "round_robin" not in lines[0]
    # p50 ratios 0.9, 1.0, 1.2 (one over 1.1); p90 ratios 1.0, 1.5, 0.9 (one over 1.1, max 1.5)
    assert "p50 median 1.00" in lines[0] and "over 1.1 on 1);" in lines[0]
    assert "max 1.50, over 1.1 on 1)" in lines[0]


def test_a_live_slice_that_cannot_run_exits_2_at_once(monkeypatch, capsys):
    """Checked before the sweep: an empty slice, a bad number, or a missing program the live runs start is one
    line and exit 2, not a traceback minutes into the live runs."""
    import shutil

    import pytest

    from kvmesh.benchmarks import bench_robust
    from kvmesh.benchmarks.peers import setups

    for name in ("ROBUST_LIVE", "ROBUST_LIVE_TIER"):
        monkeypatch.delenv(name, raising=False)
    assert bench_robust.live_seed_slice() == []
    monkeypatch.setenv("ROBUST_LIVE", "2")
    monkeypatch.setenv("ROBUST_LIVE_FROM", "4")
    monkeypatch.setattr(setups, "router_binary", lambda name: f"/bin/{name}")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no redis-server: needed with the tier only
    eval_seeds = bench_robust.load_seed_set("eval")
    assert bench_robust.live_seed_slice() == eval_seeds[4:6]
    with monkeypatch.context() as m:  # the wide draws that run live: a fleet of 3-4 replicas, in seed order
        from kvmesh.cluster.workload_wide import draw as wide_draw

        m.setenv("ROBUST_LIVE_FAMILY", "wide")
        wide = bench_robust.wide_eval_seeds()
        fleets = [s for s in wide if wide_draw(s).replicas in (3, 4)]
        assert 6 <= len(fleets) < len(wide)
        assert bench_robust.live_seed_slice() == fleets[4:6]

    def missing(name):
        raise FileNotFoundError(f"{name} not installed (pip install -e '.[bench]')")

    cases = [
        ({"ROBUST_LIVE_TIER": "1"}, None, "cannot start: redis-server is not installed: run `make services`"),
        ({"ROBUST_LIVE_FROM": str(len(eval_seeds))}, None, f"outside the {len(eval_seeds)} eval draws"),
        ({"ROBUST_LIVE": "two"}, None, "must be integers"),
        ({"ROBUST_LIVE_FAMILY": "wide", "ROBUST_LIVE_FROM": "999"}, None, "wide_eval draws of 3-4 replicas"),
        ({"ROBUST_LIVE_FAMILY": "other"}, None, "ROBUST_LIVE_FAMILY must be 'family' or 'wide'"),
        ({}, missing, "cannot start: vllm-router not installed"),
    ]
    for env, router, said in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            if router is not None:
                m.setattr(setups, "router_binary", router)
            with pytest.raises(SystemExit) as exc:
                bench_robust.live_seed_slice()
        message = capsys.readouterr().err
        assert exc.value.code == 2 and said in message and message.startswith("bench_robust: "), message
        assert message.count("\n") == 1 and message.endswith("\n")


def test_the_saved_rows_leave_the_decision_traces_to_a_file_of_their_own():
    from kvmesh.benchmarks.bench_robust import split_traces

    trace = [{"request_id": 0, "chosen": "a", "replicas": {}}]
    rows = [
        {
            "seed": 2001,
            "kvmesh": {"hit": 0.7, "decisions": trace},
            "round_robin": {"hit": 0.5, "decisions": list(trace)},
            "sim": {"hit": 0.7, "decisions": list(trace)},
            "sim_vs_live": {"first_divergence": None},
        }
    ]
    traces = split_traces(rows)
    assert traces == {"2001": {"live": trace, "sim": trace}}
    assert "decisions" not in str(rows) and rows[0]["kvmesh"] == {"hit": 0.7}

"""The robustness bench: its TTFT tail lines (one per policy but the baseline, from `sweep.ttft_against`) and the
live rows saved apart from their decision traces."""

from __future__ import annotations

import json

import pytest

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


def _run_main(monkeypatch, tmp_path, env: dict, seeds=None):
    """bench_robust.main() on `seeds` (a few draws, the same code path) with `env`; its stdout and exit code."""
    import contextlib
    import io

    from kvmesh.benchmarks import bench_robust

    for k in ("ROBUST_LIVE", "ROBUST_LIVE_FROM", "ROBUST_LIVE_FAMILY", "ROBUST_LIVE_TIER", "ROBUST_TIER_CHUNK_BLOCKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    real = bench_robust.load_seed_set
    monkeypatch.setattr(bench_robust, "load_seed_set", lambda which: seeds or real(which)[:2])
    monkeypatch.setattr(bench_robust, "plot", lambda *a, **k: None)
    buf, code = io.StringIO(), 0
    with contextlib.redirect_stdout(buf):
        try:
            bench_robust.main()
        except SystemExit as exc:
            code = exc.code
    return buf.getvalue(), code


def test_a_tuning_run_simulates_and_runs_no_eval_or_wide_eval_draw(monkeypatch, tmp_path):
    """ROBUST_SEEDS=tune: every draw simulated (the sweep, the live send order) and every draw the live slice
    takes is a tune draw; there is no wide tune set, so the wide part is skipped and says so."""
    import json

    import pytest

    from kvmesh.benchmarks import bench_robust, robust_live

    with open(bench_robust.SEEDS_FILE, encoding="utf-8") as fh:
        sets = json.load(fh)
    held_out = set(sets["eval"]) | set(sets["wide_eval"])
    seen: list[int] = []
    real_sweep, real_live = bench_robust.sweep, robust_live.simulated_live_targets

    def sweep(seeds, *a, **k):
        seen.extend(seeds)
        return real_sweep(seeds, *a, **k)

    def live_targets(seeds, *a, **k):
        seen.extend(seeds)
        return real_live(seeds, *a, **k)

    monkeypatch.setattr(bench_robust, "sweep", sweep)
    monkeypatch.setattr(robust_live, "simulated_live_targets", live_targets)
    out, _ = _run_main(monkeypatch, tmp_path, {"ROBUST_SEEDS": "tune", "ROBUST_EXACT_S": "0", "ROBUST_WIDE": "3"})
    assert seen and set(seen) <= set(sets["tune"]) and not held_out & set(seen)
    assert "second family: skipped with ROBUST_SEEDS=tune" in out
    saved = json.loads((tmp_path / "robust" / "robust.json").read_text())
    assert "seeds" not in saved["wide"] and "rows" not in saved["wide"]

    monkeypatch.setattr(robust_live, "require_live_tools", lambda tier: None)
    monkeypatch.setattr(bench_robust, "load_seed_set", lambda which: list(sets[which]))
    monkeypatch.setenv("ROBUST_LIVE", "2")
    assert bench_robust.live_seed_slice() == sets["tune"][:2]
    monkeypatch.setenv("ROBUST_LIVE_FAMILY", "wide")
    with pytest.raises(SystemExit) as exc:
        bench_robust.live_seed_slice()
    assert exc.value.code == 2


def test_exact_s_0_puts_no_shared_tier_miss_to_the_solver(monkeypatch, tmp_path):
    """ROBUST_EXACT_S=0 skips the solver for the with-tier misses too; their verdict reads "not run"."""
    from kvmesh.benchmarks import bench_robust

    calls = []
    monkeypatch.setattr(bench_robust, "decide_with_tier", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(bench_robust, "simulated_live_part", lambda *a, **k: {})
    # two tune draws kvmesh misses the target on with the tier
    out, _ = _run_main(
        monkeypatch, tmp_path, {"ROBUST_SEEDS": "tune", "ROBUST_EXACT_S": "0", "ROBUST_WIDE": "0"}, [1003, 1047]
    )
    assert calls == []
    assert "with the tier kvmesh misses the target on 2/2 draws" in out and out.count("not run)") == 2


def test_the_verdict_word_misses_when_only_a_live_check_missed(monkeypatch, tmp_path):
    """The verdict line counts what the exit status counts: a live miss makes it MISS, exit 1."""
    from kvmesh.benchmarks import bench_robust

    monkeypatch.setattr(bench_robust, "simulated_live_part", lambda *a, **k: {})
    monkeypatch.setattr(bench_robust, "live_seed_slice", lambda: [1000])
    live = {"missed": True}
    monkeypatch.setattr(bench_robust, "run_live_part", lambda out_dir, seeds: live["missed"])
    env = {"ROBUST_SEEDS": "tune", "ROBUST_EXACT_S": "0", "ROBUST_WIDE": "0"}
    # two tune draws kvmesh meets the placement target on
    out, code = _run_main(monkeypatch, tmp_path, env, [1000, 1004])
    [line] = [x for x in out.splitlines() if x.startswith("target:")]
    assert code == 1 and ": MISS (" in line and "PASS" not in line, line
    live["missed"] = False
    out, code = _run_main(monkeypatch, tmp_path, env, [1000, 1004])
    [line] = [x for x in out.splitlines() if x.startswith("target:")]
    assert code == 0 and ": PASS (" in line, line


def test_each_finished_live_draw_is_saved_before_a_later_draw_fails(monkeypatch, tmp_path):
    from kvmesh.benchmarks import bench_robust, robust_live

    def sweep(seeds, tier, family, on_row):
        on_row({"seed": seeds[0], "kvmesh": {"hit": 0.7, "decisions": [{"request_id": 0}]}})
        raise RuntimeError("the second draw's engines did not start")

    monkeypatch.setattr(robust_live, "live_sweep", sweep)
    with pytest.raises(RuntimeError):
        bench_robust.run_live_part(str(tmp_path), [2001, 2002])
    saved = json.loads((tmp_path / "robust-live.json").read_text())
    assert saved == [{"seed": 2001, "kvmesh": {"hit": 0.7}}]

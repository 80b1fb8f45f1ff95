"""The robustness sweep: its per-draw figures and summary maths on hand-made numbers, its arrival model,
one real draw end to end, and `make bench` failing when a bench reports a MISS."""

from __future__ import annotations

import sys
import types

import pytest

from kvmesh.cluster.stats import nearest_rank
from kvmesh.cluster.sweep import (
    SweepOptions,
    distribution,
    evaluate_draw,
    policy_figures,
    shared_tier_summary,
    summarize,
    target_misses,
)


def test_policy_figures_ratios_and_margin_over_the_best_other():
    f = policy_figures(
        {"kvmesh": 0.6, "round_robin": 0.3, "peer": 0.7},
        {"kvmesh": 1.1, "round_robin": 1.0, "peer": 2.0},
        merged=0.8,
        balance=0.5,
    )
    assert f["kvmesh"]["hit_over_merged"] == pytest.approx(0.75)
    assert f["kvmesh"]["hit_over_balance"] == pytest.approx(1.2)
    assert f["kvmesh"]["hit_minus_best_other"] == pytest.approx(-0.1)
    assert f["peer"]["hit_minus_best_other"] == pytest.approx(0.1)
    assert f["peer"]["prefill_max_over_mean"] == 2.0


def test_nearest_rank_quantiles():
    v = list(range(1, 11))
    assert distribution(v) == {"min": 1, "p10": 1, "median": 5, "p90": 9, "max": 10}
    assert nearest_rank([3.0], 0.5) == 3.0 and nearest_rank(v, 0.11) == 2
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


def _row(seed, ratio, imbalance):
    figures = {
        "hit": ratio,
        "hit_over_merged": ratio,
        "hit_over_balance": ratio,
        "hit_minus_best_other": ratio - 1,
        "prefill_max_over_mean": imbalance,
    }
    return {"seed": seed, "policies": {"kvmesh": figures}}


def test_summary_and_misses_on_hand_made_rows():
    rows = [_row(1, 1.0, 1.0), _row(2, 0.96, 1.1), _row(3, 0.99, 1.3), _row(4, 0.97, 1.25)]
    s = summarize(rows)["kvmesh"]
    assert s["hit_over_merged"] == {"min": 0.96, "p10": 0.96, "median": 0.97, "p90": 1.0, "max": 1.0}
    assert s["prefill_max_over_mean"]["max"] == 1.3
    assert s["hit_minus_best_other"]["min"] == pytest.approx(-0.04)
    assert [r["seed"] for r in target_misses(rows)] == [2, 3]  # 0.97 and 1.25 themselves meet the target


def test_all_at_once_draws_are_sent_by_the_closed_loop_client():
    from kvmesh.cluster.simulator import ClosedLoop
    from kvmesh.cluster.sweep import draw_trace
    from kvmesh.cluster.workload_family import draw, records

    seed = next(s for s in range(2000, 2100) if draw(s).arrival == "all")
    d = draw(seed)
    trace, sending = draw_trace(d, SweepOptions())
    client = sending["client"]
    assert isinstance(client, ClosedLoop) and client.concurrency == d.concurrency
    assert client.users == [r.get("user") for r in records(d)] and len(trace) == len(client.users)


def test_timed_draws_are_sent_at_their_times_a_users_turn_after_its_previous_reply():
    from kvmesh.cluster.sweep import draw_trace
    from kvmesh.cluster.workload_family import draw, records

    seed = next(s for s in range(2000, 2100) if draw(s).arrival != "all" and draw(s).turns > 1)
    d = draw(seed)
    trace, sending = draw_trace(d, SweepOptions())
    client = sending["client"]
    assert client.users == [r.get("user") for r in records(d)]
    assert client.arrivals is not None and len(client.arrivals) == len(trace)
    assert client.arrivals == sorted(client.arrivals) and client.arrivals[-1] > 0
    assert client.concurrency >= len(trace)  # open loop: no cap beyond the users' own order


def test_one_draw_end_to_end():
    from kvmesh.cluster.workload_family import draw

    row = evaluate_draw(draw(2005), ("kvmesh", "round_robin"))
    b = row["bounds"]
    assert row["seed"] == 2005 and row["requests"] == draw(2005).requests
    assert b["merged_lru"] == pytest.approx(b["infinite"])  # room for every block: nothing evicted
    assert b["balance"] <= b["infinite"] + 1e-12 and b["balance_at_target"] >= b["balance"] - 1e-12
    for name, p in row["policies"].items():
        assert 0 < p["hit"] <= b["infinite"] + 1e-12, name
        assert p["prefill_max_over_mean"] >= 1.0
    assert row["policies"]["kvmesh"]["hit"] > row["policies"]["round_robin"]["hit"]


def test_with_a_shared_tier_a_replica_lacking_a_prefix_loads_it_instead_of_recomputing():
    from kvmesh.cluster.workload_family import draw

    row = evaluate_draw(draw(2001), ("kvmesh", "round_robin"))
    tier = row["shared_tier"]
    # round robin spreads every conversation: without a tier it recomputes histories, with one it loads them
    # (a turn comes after the previous reply, so its history is stored by then)
    assert row["policies"]["round_robin"]["hit_over_merged"] < 0.8
    for name in ("kvmesh", "round_robin"):
        assert tier[name]["hit_over_merged"] >= 0.98, name
        assert tier[name]["ttft_p50_s"] > 0
        met = tier[name]["hit_over_merged"] >= 0.97 and tier[name]["prefill_max_over_mean"] <= 1.25
        assert tier[name]["meets_target"] == met, name
    assert tier["kvmesh"]["meets_target"]
    assert evaluate_draw(draw(2001), ("kvmesh",), SweepOptions(shared_tier=False))["shared_tier"] == {}


def test_shared_tier_summary_counts_draws_meeting_the_target_and_the_ttft_ratio():
    def row(hit, imbalance, meets, ttft_with, ttft_without):
        return {
            "policies": {"kvmesh": {"ttft_p50_s": ttft_without}},
            "shared_tier": {
                "kvmesh": {
                    "hit_over_merged": hit,
                    "prefill_max_over_mean": imbalance,
                    "ttft_p50_s": ttft_with,
                    "meets_target": meets,
                }
            },
        }

    s = shared_tier_summary(
        [row(1.0, 1.1, True, 0.5, 1.0), row(0.99, 1.4, False, 0.9, 1.0), row(1.0, 1.2, True, 2.0, 1.0)]
    )
    k = s["kvmesh"]
    assert (k["meets"], k["draws"]) == (2, 3)
    assert k["hit_over_merged"]["min"] == 0.99 and k["prefill_max_over_mean"]["max"] == 1.4
    assert k["ttft_with_over_without"] == pytest.approx(0.9)  # the median of 0.5, 0.9, 2.0
    assert shared_tier_summary([{"policies": {}, "shared_tier": {}}]) == {}


def test_run_all_exits_non_zero_when_a_bench_exits_non_zero(monkeypatch):
    from kvmesh.benchmarks import run_all

    def bench(code):
        mod = types.ModuleType("kvmesh.benchmarks.bench_fake")

        def main():
            raise SystemExit(code)

        mod.main = main
        return mod

    monkeypatch.setattr(run_all.pkgutil, "iter_modules", lambda path: [types.SimpleNamespace(name="bench_fake")])
    monkeypatch.setitem(sys.modules, "kvmesh.benchmarks.bench_fake", bench(1))
    assert run_all.main(["fake"]) == 1
    monkeypatch.setitem(sys.modules, "kvmesh.benchmarks.bench_fake", bench(0))
    assert run_all.main(["fake"]) == 0


def test_a_rows_exact_steps_redraw_its_own_family():
    """The exact solvers redraw a row's workload from its seed: from the family that made it, not always the
    first one (a wide row would have been settled on another workload under the same seed)."""
    from kvmesh.cluster import sweep as sweep_module
    from kvmesh.cluster import workload_wide

    d = workload_wide.draw(11001)
    row = sweep_module.evaluate_draw(d, ["round_robin"], sweep_module.SweepOptions(shared_tier=False))
    assert row["family"] == "workload_wide"
    assert sweep_module._redraw(row).describe() == d.describe()

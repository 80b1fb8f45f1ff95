"""The robustness bench's TTFT tail lines: one per policy but the baseline, from `sweep.ttft_against`."""

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

"""trace_draw: a bad seed is one line and exit 2; the report names where the live and simulated runs part
(the live run replaced by the simulator's own decisions moved at one request)."""

from __future__ import annotations

import json

import pytest

from kvmesh.benchmarks import trace_draw


def test_a_seed_that_is_not_a_number_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        trace_draw.main(["twenty"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "trace_draw: SEED must be an integer, got 'twenty'"


def test_the_report_shows_the_first_request_placed_differently(monkeypatch, tmp_path, capsys):
    from kvmesh.benchmarks import robust_live

    def fake_live(recs, d, n, policy, log, tier=False):  # the simulator's run, one placement moved
        sim = robust_live.simulate_in_send_order(recs, d, n, policy)
        trace = [dict(x) for x in sim["decisions"]]
        used = set()
        for k, x in enumerate(trace):
            if len(used) == n:
                x["chosen"] = next(r for r in x["replicas"] if r != x["chosen"])
                moved = k
                break
            used.add(x["chosen"])
        return {**sim, "errors": 0, "decisions": trace, "moved": moved}

    monkeypatch.setattr(robust_live, "run_live", fake_live)
    out = tmp_path / "t.json"
    assert trace_draw.main(["2000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    k = saved["live"]["moved"]
    assert saved["sim_vs_live"]["first_divergence"]["position"] == k
    assert f"first placement that differs: request {saved['sim']['decisions'][k]['request_id']} (#{k} in order)" in text
    assert "placed alike 100%" in text  # only the trace was moved, not the placements the figures count

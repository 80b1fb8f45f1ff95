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


def _recording_run_live(monkeypatch):
    """run_live replaced by the simulator's run of the same draw; records each draw it is given."""
    from kvmesh.benchmarks import robust_live

    seen = []

    def fake_live(recs, d, n, policy, log, tier=False):
        seen.append((d, len(recs), n))
        return {**robust_live.simulate_in_send_order(recs, d, n, policy), "errors": 0}

    monkeypatch.setattr(robust_live, "run_live", fake_live)
    return seen


def test_a_wide_eval_seed_replays_the_wide_familys_draw(monkeypatch, tmp_path, capsys):
    from kvmesh.benchmarks.robust_live import live_replicas
    from kvmesh.cluster import workload_family, workload_wide

    seen = _recording_run_live(monkeypatch)
    assert trace_draw.main(["11001", "--json", str(tmp_path / "w.json")]) == 0
    assert trace_draw.main(["2000", "--json", str(tmp_path / "f.json")]) == 0
    wide, first = workload_wide.draw(11001), workload_family.draw(2000)
    assert [(type(d), k, n) for d, k, n in seen] == [
        (type(wide), len(wide.records()), live_replicas(wide)),
        (type(first), len(first.records()), live_replicas(first)),
    ]
    assert json.loads((tmp_path / "w.json").read_text())["family"] == "wide"
    assert trace_draw.seed_family(1000) == "family" and trace_draw.seed_family(11199) == "wide"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["3000"], "trace_draw: seed 3000 is in no set of benchmarks/robust_seeds.json; name its --family"),
        (["11001", "--family", "family"], "trace_draw: seed 11001 is a 'wide' draw in benchmarks/robust_seeds.json"),
        (["3000", "--family", "other"], "trace_draw: --family must be one of family, wide, got 'other'"),
    ],
)
def test_a_seed_of_no_set_or_the_wrong_family_is_one_line_and_exit_2(argv, said, monkeypatch, capsys):
    seen = _recording_run_live(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        trace_draw.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(said) and err.count("\n") == 1 and not seen


def test_a_seed_of_no_set_runs_with_its_family_named(monkeypatch, tmp_path):
    from kvmesh.cluster import workload_wide

    seen = _recording_run_live(monkeypatch)
    assert trace_draw.main(["12000", "--family", "wide", "--json", str(tmp_path / "x.json")]) == 0
    assert type(seen[0][0]) is type(workload_wide.draw(12000))


def test_the_report_of_a_live_run_with_no_successful_request_prints_dashes():
    """A live run none of whose requests succeeded has no hit rate, TTFT or prefill max/mean (None)."""
    from kvmesh.benchmarks.robust_live import compare

    live = {"hit": None, "prefill_max_over_mean": None, "ttft_p50_s": None, "requests": [0, 0], "errors": 8}
    sim = {"hit": 0.6, "prefill_max_over_mean": 1.1, "ttft_p50_s": 0.05, "requests": [4, 4]}
    text = trace_draw.report({"live": live, "sim": sim, "sim_vs_live": dict(compare(live, sim), first_divergence=None)})
    lines = text.splitlines()
    assert lines[0] == "live: hit -, prefill max/mean -, requests per replica [0, 0], TTFT p50 - ms"
    assert lines[2] == "apart by: hit -, max/mean -, requests -; placed alike -"

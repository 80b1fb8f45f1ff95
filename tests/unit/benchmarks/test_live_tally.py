import json

import pytest
from live_rows import live_row

from kvmesh.benchmarks.live_tally import format_tally, load_rows, main, tally


def _row(seed: int, hit: float, max_over_mean: float, tier_hit: float | None = None) -> dict:
    return live_row(hit, seed=seed, max_over_mean=max_over_mean, tier_hit=tier_hit)


def _write(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return str(path)


def test_a_later_file_replaces_an_earlier_row_and_each_check_lists_the_draws_it_missed(tmp_path):
    a = _write(tmp_path, "a.json", [_row(1, 0.77, 1.1, tier_hit=0.8), _row(2, 0.77, 1.4, tier_hit=0.79)])
    b = _write(tmp_path, "b.json", [_row(2, 0.77, 1.1, tier_hit=0.79), _row(3, 0.5, 1.1)])
    t = tally(load_rows([a, b]))
    assert t["draws"] == [1, 2, 3]
    assert t["every_no_tier_target"] == [1, 2]  # 2's pile-up was replaced by the later run; 3 is under the bound
    assert t["checks"]["hit >= 0.95 x balance-bounded"]["missed"] == [3]
    assert t["with_lmcache"] == [1, 2] and t["at_infinite_bound_with_lmcache"] == [1]
    assert t["checks"]["with LMCache: TTFT p50 <= round robin's with LMCache"]["missed"] == [1, 2]
    assert t["ttft_ratio_median"] == {"no tier": pytest.approx(0.5), "with LMCache": pytest.approx(1.5)}
    text = format_tally(t)
    assert "every live target without a tier: 2/3" in text
    assert "with LMCache at the infinite-cache bound: 1/2 (below: [2])" in text


def test_a_missing_or_malformed_file_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "none.json")])
    assert exc.value.code == 2 and "live_tally:" in capsys.readouterr().err
    bad = _write(tmp_path, "bad.json", [{"seed": 1}])
    with pytest.raises(SystemExit) as exc:
        main([bad])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "not a list of live robustness rows" in err and len(err.strip().splitlines()) == 1


def test_simulate_judges_every_draw_with_the_shared_tier_arms_simulated_again(tmp_path, capsys):
    from kvmesh.benchmarks.robust_live import simulate_in_send_order
    from kvmesh.cluster.workload_family import draw, records

    rows = [_row(seed, 0.77, 1.1, tier_hit=0.8) for seed in (2000, 2001, 2002)]
    path = _write(tmp_path, "a.json", rows)
    name = "simulated with a shared tier: TTFT p50 <= round robin's"
    assert name not in tally(load_rows([path]))["checks"]  # the saved rows have no simulated tier arms

    held = []
    for seed in (2000, 2001, 2002):
        d = draw(seed)
        k, rr = (simulate_in_send_order(records(d), d, 2, p, shared=True) for p in ("kvmesh", "round_robin"))
        if k["ttft_p50_s"] <= rr["ttft_p50_s"]:
            held.append(seed)
    assert main(["--simulate", path]) == 0
    out = capsys.readouterr().out
    missed = sorted({2000, 2001, 2002} - set(held))
    assert f"{name}: {len(held)}/3" + (f", missed {missed}" if missed else "") in out


def test_simulate_draws_a_wide_row_from_the_wide_family(tmp_path):
    from kvmesh.benchmarks.live_tally import simulate_tier_arms
    from kvmesh.benchmarks.robust_live import simulate_in_send_order
    from kvmesh.cluster.workload_wide import draw as wide_draw

    row = {**_row(11001, 0.77, 1.1, tier_hit=0.8), "family": "wide", "replicas": 4}
    rows = load_rows([_write(tmp_path, "w.json", [row])])
    simulate_tier_arms(rows)
    d = wide_draw(11001)
    want = simulate_in_send_order(d.records(), d, 4, "kvmesh", shared=True)
    assert rows[11001]["sim_tier"]["hit"] == want["hit"] and rows[11001]["sim_tier"]["requests"] == want["requests"]


def test_a_draw_whose_runs_served_nothing_misses_its_checks_and_adds_no_ratio(tmp_path):
    dead = _row(4, 0.77, 1.1, tier_hit=0.8)
    dead["kvmesh"]["ttft_p50_s"] = None
    dead["kvmesh_tier"]["hit"] = dead["kvmesh_tier"]["ttft_p50_s"] = None
    t = tally(load_rows([_write(tmp_path, "a.json", [_row(1, 0.77, 1.1, tier_hit=0.8), dead])]))
    assert t["at_infinite_bound_with_lmcache"] == [1]
    assert t["ttft_ratio_median"]["no tier"] == pytest.approx(0.5)  # draw 1's alone
    assert 4 not in t["every_no_tier_target"]

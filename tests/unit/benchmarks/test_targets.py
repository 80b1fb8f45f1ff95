"""`make bench` fails on a missed target: a bench prints its whole report, then exits 1 (`Targets`), and
`run_all` turns that into a non-zero exit. Fake benches and real benches with their measurements
replaced; no engines."""

from __future__ import annotations

import sys
import types

import pytest

from kvmesh.benchmarks import run_all
from kvmesh.benchmarks.targets import Targets


def _only(monkeypatch, name: str, module: types.ModuleType | None = None) -> None:
    """run_all sees one bench, `name`; a fake module stands in for it when given."""
    monkeypatch.setattr(run_all.pkgutil, "iter_modules", lambda path: [types.SimpleNamespace(name=name)])
    if module is not None:
        monkeypatch.setitem(sys.modules, f"kvmesh.benchmarks.{name}", module)


def _fake_bench(ok: bool) -> types.ModuleType:
    mod = types.ModuleType("kvmesh.benchmarks.bench_fake")

    def main():
        targets = Targets()
        print(f"figure 1.0 {targets.verdict('the fake target', ok)}")
        print("report ends")
        targets.exit_if_missed()

    mod.main = main
    return mod


@pytest.mark.parametrize("ok, status", [(True, 0), (False, 1)])
def test_a_bench_whose_target_misses_makes_run_all_exit_non_zero(monkeypatch, capsys, ok, status):
    _only(monkeypatch, "bench_fake", _fake_bench(ok))
    assert run_all.main(["fake"]) == status
    out = capsys.readouterr().out
    assert "report ends" in out  # the whole report is printed before the exit
    assert ("exited non-zero: bench_fake" in out) == (not ok)
    assert ("MISS: 1 target(s) missed: the fake target" in out) == (not ok)


def test_targets_remember_each_miss():
    t = Targets()
    assert t.verdict("a", True) == "PASS" and t.verdict("b", False) == "MISS" and t.verdict("c", False) == "MISS"
    with pytest.raises(SystemExit) as exc:
        t.exit_if_missed()
    assert exc.value.code == 1 and t.missed == ["b", "c"]
    Targets().exit_if_missed()  # nothing missed: returns


@pytest.mark.parametrize("kept, status", [(0.95, 0), (0.5, 1)])
def test_bench_tenants_exits_non_zero_when_isolation_keeps_too_little(monkeypatch, kept, status):
    from kvmesh.benchmarks import bench_tenants

    row = {
        "tenants": 64,
        "cache": "lru_4M_tokens",
        "shared_salt": 0.4,
        "isolated": 0.4 * kept,
        "cost": 0.4 * (1 - kept),
        "kept": kept,
    }
    saas = {
        "tenants": 2,
        "preamble_blocks": 1,
        "requests": 4,
        "no_common_text": {"shared_salt": 0.3, "isolated": 0.3},
        "public_preamble": {"shared_salt": 0.4, "isolated": 0.3, "groups_of_2": 0.35},
    }
    monkeypatch.setattr(bench_tenants, "mooncake_figures", lambda: [row])
    monkeypatch.setattr(bench_tenants, "saas_figures", lambda: saas)
    monkeypatch.delenv("BENCH_JSON_DIR", raising=False)
    _only(monkeypatch, "bench_tenants")
    assert run_all.main(["tenants"]) == status


@pytest.mark.parametrize("kvmesh_uncached, status", [(50, 0), (90, 1)])
def test_bench_live_exits_non_zero_on_a_miss(monkeypatch, tmp_path, kvmesh_uncached, status):
    from kvmesh.benchmarks import bench_live

    def summary(uncached, hit, p50):
        return {
            "uncached_prompt_tokens": uncached,
            "hit_rate_tokens": hit,
            "ttft_p50_s": p50,
            "ttft_p90_s": p50,
            "errors": 0,
            "requests": 1,
            "prompt_tokens": 100,
            "cached_tokens": 100 - uncached,
        }

    def run_live(records, policies, replicas):  # no engines: the figures a run would return
        return {"kvmesh": summary(kvmesh_uncached, 0.95, 0.05), "round_robin": summary(100, 0.4, 0.1)}

    monkeypatch.setattr(bench_live, "run_live", run_live)
    monkeypatch.setattr(
        bench_live,
        "record_bounds",
        lambda *a, **k: {
            "prompt_tokens": 100,
            "infinite": {"hit_rate": 1.0},
            "round_robin_infinite": {"hit_rate": 0.5, "replicas": 4},
        },
    )
    monkeypatch.setattr(bench_live, "plot", lambda *a: None)
    monkeypatch.setattr("kvmesh.deployments.replay.format_table", lambda results: "table")
    monkeypatch.chdir(tmp_path)
    _only(monkeypatch, "bench_live")
    assert run_all.main(["live"]) == status
    assert (tmp_path / "out" / "live" / "bench_live.json").is_file()  # the report is written before the exit


def test_bench_tiers_exits_non_zero_when_a_tier_loads_slower_than_recompute(monkeypatch, capsys):
    from kvmesh.benchmarks import bench_tiers

    run = {"prefill_s": 0.01, "num_cached_tokens": 256}
    m = {
        "rows": [{"n": 256, "cold": run, "hbm": run, "host": run, "shared": run}],
        "host_hit_tokens": 256,
        "shared_hit_tokens": 256,
        "hbm_s": 0.01,
        "prefill_s_per_token": 1e-5,
        "host_load_s_per_token": 5e-6,
        "shared_load_s_per_token": 2e-5,
        "host_hits": 1,
        "shared_hits": 1,
    }
    monkeypatch.setattr(bench_tiers, "measure", lambda model, root: m)
    with pytest.raises(SystemExit) as exc:
        bench_tiers.main(["--model", "unused"])
    out = capsys.readouterr().out
    assert exc.value.code == 1 and "host: load" in out and "-> PASS" in out and "shared: load" in out
    assert "MISS: 1 target(s) missed: shared tier load < recompute" in out


def test_a_bench_name_that_matches_nothing_fails_instead_of_running_nothing(capsys):
    """BENCH=robsut ran no benchmark and exited 0: a typo passed CI having measured nothing."""
    assert run_all.main(["robsut"]) == 2
    assert "no benchmark named robsut" in capsys.readouterr().err
    assert run_all.main(["robust", "typo"]) == 2

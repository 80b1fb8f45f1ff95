"""`make bench` fails on a missed target: a bench prints its whole report, then exits 1 (`Targets`), and
`run_all` turns that into a non-zero exit. Fake benches and real benches with their measurements
replaced; no engines."""

from __future__ import annotations

import contextlib
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
def test_bench_tenants_exits_non_zero_when_isolation_keeps_too_little(monkeypatch, tmp_path, kept, status):
    from kvmesh.benchmarks import bench_tenants

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))  # its report and plot

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

    def run_live(records, policies, replicas, on_result=None):  # no engines: the figures a run would return
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


def test_bench_tiers_exits_non_zero_when_a_tier_loads_slower_than_recompute(monkeypatch, capsys, tmp_path):
    from kvmesh.benchmarks import bench_tiers

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))

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


def _recording_benches(monkeypatch, names: list[str]) -> list[str]:
    """run_all sees the benches `names`, each a fake module whose main() records that it ran."""
    ran: list[str] = []
    monkeypatch.setattr(run_all.pkgutil, "iter_modules", lambda path: [types.SimpleNamespace(name=n) for n in names])
    for name in names:
        mod = types.ModuleType(f"kvmesh.benchmarks.{name}")
        mod.main = lambda name=name: ran.append(name)
        monkeypatch.setitem(sys.modules, f"kvmesh.benchmarks.{name}", mod)
    return ran


def test_a_bench_name_that_selects_only_an_opt_in_bench_fails_instead_of_running_nothing(monkeypatch, capsys):
    """BENCH=sim passed the unknown-name check (bench_sim_speed starts with sim_), then the opt-in filter
    skipped bench_sim_speed: nothing ran and the exit was 0; in BENCH=scale_sim,sim the sim part was dropped."""
    ran = _recording_benches(monkeypatch, ["bench_scale_sim", "bench_sim_speed", "bench_simulator"])
    assert run_all.main(["sim"]) == 2 and ran == []
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "BENCH: sim selects no benchmark" in err and "sim_speed" in err
    assert run_all.main(["scale_sim", "sim"]) == 2 and ran == []
    assert "BENCH: sim selects no benchmark" in capsys.readouterr().err
    assert run_all.main(["sim_speed"]) == 0 and ran == ["bench_sim_speed"]
    ran.clear()
    assert run_all.main(["bench_sim_speed"]) == 0 and ran == ["bench_sim_speed"]
    ran.clear()
    assert run_all.main(["simulator"]) == 0 and ran == ["bench_simulator"]
    ran.clear()
    assert run_all.main(["scale_sim", "sim_speed"]) == 0 and ran == ["bench_scale_sim", "bench_sim_speed"]
    ran.clear()
    assert run_all.main([]) == 0 and ran == ["bench_scale_sim", "bench_simulator"]  # all but the opt-in ones


@pytest.mark.parametrize("returned, status", [(1, 1), (3, 1), (0, 0), (None, 0), ({"figure": 1.0}, 0)])
def test_a_bench_main_returning_a_non_zero_int_makes_run_all_exit_non_zero(monkeypatch, capsys, returned, status):
    """entry.run_main exits with an int a bench's main() returns; run_all ignored it and exited 0."""
    mod = types.ModuleType("kvmesh.benchmarks.bench_fake")
    mod.main = lambda: returned
    _only(monkeypatch, "bench_fake", mod)
    assert run_all.main(["fake"]) == status
    assert ("exited non-zero: bench_fake" in capsys.readouterr().out) == bool(status)


@pytest.mark.parametrize("shared_hits, status", [(1, 1), (11, 1), (12, 0)])
def test_bench_tiers_misses_when_a_tier_does_not_hit_on_every_try(monkeypatch, capsys, tmp_path, shared_hits, status):
    """The load cost was judged on the tries that hit only: a shared tier that served 1 of 12 passed."""
    from kvmesh.benchmarks import bench_tiers

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))

    def run(s, cached):
        return {"prefill_s": s, "num_cached_tokens": cached}

    rows = [
        {
            "n": 512,
            "cold": run(0.05, 0),
            "hbm": run(0.02, 511),
            "host": run(0.025, 511),
            "shared": run(0.021, 511) if i < shared_hits else run(0.05, 0),
        }
        for i in range(12)
    ]
    m = {
        "rows": rows,
        "host_hit_tokens": 511.0 * 12,
        "shared_hit_tokens": 511.0 * shared_hits,
        "hbm_s": 0.02,
        "prefill_s_per_token": 0.03 / 511,
        "host_load_s_per_token": 0.005 / 511,
        "shared_load_s_per_token": 0.001 / 511,
        "cold_hits": 12,
        "host_hits": 12,
        "shared_hits": shared_hits,
    }
    monkeypatch.setattr(bench_tiers, "measure", lambda model, root: m)
    with pytest.raises(SystemExit) if status else contextlib.nullcontext() as exc:
        bench_tiers.main(["--model", "unused"])
    out = capsys.readouterr().out
    assert (exc.value.code if status else 0) == status
    assert "host: 12/12 tries hit -> PASS" in out
    assert f"shared: {shared_hits}/12 tries hit -> {'MISS' if status else 'PASS'}" in out
    assert "shared: load" in out and "-> PASS (target: load < recompute)" in out  # the cost target stays
    assert ("MISS: 1 target(s) missed: shared tier hit on every try" in out) == bool(status)


class _FakeTierServer:
    """An LMCache server stand-in for bench_tiers.measure: its tier_metrics() answers `metrics`."""

    metrics: dict = {}

    def __init__(self, cfg, log):
        self.endpoint = ("127.0.0.1", 1)

    def launch(self):
        pass

    def wait_ready(self):
        pass

    def stop(self):
        pass

    def tier_metrics(self):
        return dict(self.metrics)


class _FakeRedis:
    def __init__(self, *a):
        self.url = "redis://127.0.0.1:1"

    def start(self):
        return self

    def stop(self):
        pass


class _FakeEngine:
    """A probe engine whose prefix cache survives everything: a prompt seen before is an in-engine hit.
    `reset_ok` is what reset_prefix_cache() answers (vLLM: False when blocks are still held, nothing reset)."""

    def __init__(self, reset_ok: bool):
        self.seen: set = set()
        self.reset_ok = reset_ok

    def wait_ready(self, timeout=0):
        return self

    def generate(self, p):
        hit = tuple(p) in self.seen
        self.seen.add(tuple(p))
        return {"prefill_s": 0.1 if hit else 0.1 + 4e-4 * len(p), "num_cached_tokens": len(p) - 32 if hit else 0}

    def reset_prefix_cache(self):
        if self.reset_ok:
            self.seen.clear()
        return self.reset_ok


def _fake_tiers(monkeypatch, tmp_path, metrics: dict, reset_ok: bool) -> None:
    """bench_tiers.measure on fakes: one engine serves as both A and B (B's run is then a hit, as a shared
    load would be), LMCache's counters answer `metrics`."""
    import kvmesh.kvstore.lmcache_server as lmcache_server
    import kvmesh.kvstore.probe_engine as probe_engine
    import kvmesh.kvstore.redis_process as redis_process
    from kvmesh.benchmarks import bench_tiers

    engine = _FakeEngine(reset_ok)
    monkeypatch.setattr(_FakeTierServer, "metrics", metrics)
    monkeypatch.setattr(lmcache_server, "LMCacheServer", _FakeTierServer)
    monkeypatch.setattr(redis_process, "RedisServer", _FakeRedis)
    monkeypatch.setattr(probe_engine, "EngineProcess", lambda *a, **k: engine)
    monkeypatch.setattr(probe_engine, "stop_engines", lambda engines: None)
    monkeypatch.setattr(bench_tiers, "REPEATS", 1)
    monkeypatch.setattr(bench_tiers.time, "sleep", lambda s: None)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    for k in bench_tiers.ENV:  # measure() sets them for its engines: put back after the test
        monkeypatch.setenv(k, bench_tiers.ENV[k])


def test_bench_tiers_counts_a_failed_prefix_cache_reset_and_empty_lmcache_counters_as_misses(
    monkeypatch, capsys, tmp_path
):
    """reset_prefix_cache()'s False was ignored: the host run was an in-engine hit, timed as a free host-tier
    load, and LMCache's counters (0 hit tokens in either tier) were printed, not judged: the bench passed."""
    from kvmesh.benchmarks import bench_tiers

    _fake_tiers(monkeypatch, tmp_path, {"host_hit_tokens": 0.0, "shared_hit_tokens": 0.0}, reset_ok=False)
    with pytest.raises(SystemExit) as exc:
        bench_tiers.main(["--model", "unused"])
    out = capsys.readouterr().out
    assert exc.value.code == 1
    tries = len(bench_tiers.LENGTHS)
    assert f"host: 0/{tries} tries hit; {tries} prefix-cache resets failed, each a miss -> MISS" in out
    assert "LMCache counters: host hit tokens 0 -> MISS (target: > 0)" in out
    assert "LMCache counters: shared hit tokens 0 -> MISS (target: > 0)" in out


def test_bench_tiers_reports_its_timings_when_lmcache_does_not_answer(monkeypatch, capsys, tmp_path):
    """tier_metrics() answers {} when the server does not answer: a KeyError after every timing was taken
    lost them all. Now the counters are missing (a miss) and the rows are written."""
    import json

    from kvmesh.benchmarks import bench_tiers

    _fake_tiers(monkeypatch, tmp_path, {}, reset_ok=False)
    with pytest.raises(SystemExit) as exc:
        bench_tiers.main(["--model", "unused"])
    out = capsys.readouterr().out
    assert exc.value.code == 1
    assert "LMCache counters: host hit tokens n/a (server did not answer) -> MISS" in out
    report = json.loads((tmp_path / "tiers" / "tiers.json").read_text())
    assert len(report["rows"]) == len(bench_tiers.LENGTHS) and report["host_hit_tokens"] is None


@pytest.mark.parametrize("missed", [False, True])
def test_bench_tiers_writes_its_report_and_plot_under_bench_out(monkeypatch, capsys, tmp_path, missed):
    """Under `make bench` (no --json) bench_tiers wrote nothing."""
    from kvmesh.benchmarks import bench_tiers

    def run(s, cached):
        return {"prefill_s": s, "num_cached_tokens": cached}

    row = {"n": 256, "reset": True, "cold": run(0.2, 0), "hbm": run(0.1, 224), "host": run(0.11, 224)}
    row["shared"] = run(0.2, 0) if missed else run(0.12, 224)
    m = {
        "rows": [row],
        "host_hit_tokens": 224.0,
        "shared_hit_tokens": 0.0 if missed else 224.0,
        "hbm_s": 0.1,
        "prefill_s_per_token": 0.1 / 224,
        "host_load_s_per_token": 0.01 / 224,
        "shared_load_s_per_token": None if missed else 0.02 / 224,
        "host_hits": 1,
        "shared_hits": 0 if missed else 1,
    }
    monkeypatch.setattr(bench_tiers, "measure", lambda model, root: m)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    with pytest.raises(SystemExit) if missed else contextlib.nullcontext():
        bench_tiers.main(["--model", "unused"])
    assert (tmp_path / "tiers" / "tiers.json").is_file() and (tmp_path / "tiers" / "tiers.png").is_file()

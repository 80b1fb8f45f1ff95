"""bench_failover's verdicts: each run judged on its own failures and on the migrations /metrics counted
while it ran. The app (start_local), the replay (failover_run.run) and /metrics (failover_run.metric) are
faked; no engines."""

from __future__ import annotations

import tempfile

import pytest

from kvmesh.benchmarks import bench_failover
from kvmesh.benchmarks.failover_run import RunReport, StreamResult


def _report(failed: int, killed: bool) -> RunReport:
    results = [
        StreamResult(
            i,
            0,
            status=503 if i < failed else 200,
            done=i >= failed,
            prompt_tokens=100,
            cached_tokens=50,
            finished_at=float(i),
        )
        for i in range(30)
    ]
    report = RunReport(results)
    if killed:
        report.killed_replica, report.killed_pid, report.killed_after, report.open_on_killed = "r1", 1, 10, 1
    return report


def _fake_app(monkeypatch, tmp_path, *, failed: dict[str, int], migrations: dict[str, int]) -> None:
    """An app whose /metrics counters grow by `migrations[run]` while that run replays, and whose runs
    fail `failed[run]` requests (run: "untouched" or "killed")."""
    import kvmesh.deployments.app as app

    counters = {"kvmesh_migrations_total": 0.0}  # the other counters stay 0

    def run(url, headers, convs, *, concurrency, max_tokens, kill_at=None):
        name = "untouched" if kill_at is None else "killed"
        counters["kvmesh_migrations_total"] += migrations[name]
        return _report(failed[name], kill_at is not None)

    monkeypatch.setattr(app, "start_local", lambda config, num_cpus: "http://127.0.0.1:9")
    monkeypatch.setattr(app, "stop_local", lambda: None)
    monkeypatch.setattr(bench_failover, "run", run)
    monkeypatch.setattr(bench_failover, "metric", lambda client, name: counters.get(name, 0.0))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # run_app's tenants file
    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("BENCH_FAILOVER_CONVERSATIONS", "2")
    monkeypatch.setenv("BENCH_FAILOVER_TURNS", "2")


def _main(capsys) -> tuple[int, str]:
    try:
        bench_failover.main()
    except SystemExit as exc:
        return int(exc.code or 0), capsys.readouterr().out
    return 0, capsys.readouterr().out


def test_a_migration_in_the_untouched_run_does_not_meet_the_killed_runs_migration_target(monkeypatch, tmp_path, capsys):
    """The counter was read once after both runs: a move during the untouched run met the killed run's
    target although the kill moved nothing."""
    _fake_app(monkeypatch, tmp_path, failed={"untouched": 0, "killed": 0}, migrations={"untouched": 1, "killed": 0})
    status, out = _main(capsys)
    assert status == 1
    assert "MISS  migrations counted in /metrics (killed run): 0.000 (target >= 1)" in out
    assert "MISS  migrations counted in /metrics (untouched run): 1.000 (target == 0)" in out


@pytest.mark.parametrize("untouched, killed", [(0, 1), (0, 2), (1, 1)])
def test_the_migration_targets_judge_what_each_run_added(monkeypatch, tmp_path, capsys, untouched, killed):
    _fake_app(
        monkeypatch,
        tmp_path,
        failed={"untouched": 0, "killed": 0},
        migrations={"untouched": untouched, "killed": killed},
    )
    status, out = _main(capsys)
    assert f"PASS  migrations counted in /metrics (killed run): {killed:.3f}" in out
    assert f"{'PASS' if untouched == 0 else 'MISS'}  migrations counted in /metrics (untouched run)" in out
    assert status == (0 if untouched == 0 else 1)


@pytest.mark.parametrize("base_failed, killed_failed", [(3, 0), (0, 2), (0, 0)])
def test_each_runs_failed_requests_are_printed_and_judged_on_their_own_row(
    monkeypatch, tmp_path, capsys, base_failed, killed_failed
):
    """One row "failed requests (killed run)" judged both runs but printed only the killed run's count: an
    untouched run with 3 failures printed MISS beside 0.000."""
    _fake_app(
        monkeypatch,
        tmp_path,
        failed={"untouched": base_failed, "killed": killed_failed},
        migrations={"untouched": 0, "killed": 1},
    )
    status, out = _main(capsys)
    for run, n in (("untouched", base_failed), ("killed", killed_failed)):
        assert f"{'PASS' if n == 0 else 'MISS'}  failed requests ({run} run): {n:.3f} (target == 0)" in out
    assert status == (1 if base_failed or killed_failed else 0)


def test_the_tenants_file_with_its_key_digests_leaves_with_the_run(monkeypatch, tmp_path, capsys):
    _fake_app(monkeypatch, tmp_path, failed={"untouched": 0, "killed": 0}, migrations={"untouched": 0, "killed": 1})
    _main(capsys)
    assert not list(tmp_path.glob("kvmesh-bench-failover-*"))  # it stayed in the temp folder after every run


def test_the_untouched_runs_figures_survive_a_failing_killed_run(monkeypatch, tmp_path, capsys):
    """The JSON was written only after both runs: a killed run that raised lost the untouched run's figures.
    Now each run rewrites it, marked incomplete, and the failure still ends the bench with an error."""
    import json

    _fake_app(monkeypatch, tmp_path, failed={"untouched": 0, "killed": 0}, migrations={"untouched": 0, "killed": 1})
    fake_run = bench_failover.run

    def run(url, headers, convs, *, concurrency, max_tokens, kill_at=None):
        if kill_at is not None:
            raise RuntimeError("no replica to kill (fake)")
        return fake_run(url, headers, convs, concurrency=concurrency, max_tokens=max_tokens, kill_at=kill_at)

    monkeypatch.setattr(bench_failover, "run", run)
    with pytest.raises(RuntimeError):
        bench_failover.main()
    report = json.loads((tmp_path / "out" / "failover" / "bench_failover.json").read_text())
    assert report["complete"] is False
    assert "killed" not in report and len(report["untouched"]["results"]) == 30
    assert report["counters"] == {"untouched": {name: 0.0 for name in bench_failover.COUNTERS}}


def test_a_finished_run_is_marked_complete(monkeypatch, tmp_path, capsys):
    import json

    _fake_app(monkeypatch, tmp_path, failed={"untouched": 0, "killed": 0}, migrations={"untouched": 0, "killed": 1})
    assert _main(capsys)[0] == 0
    report = json.loads((tmp_path / "out" / "failover" / "bench_failover.json").read_text())
    assert report["complete"] is True and {"untouched", "killed", "targets"} <= set(report)

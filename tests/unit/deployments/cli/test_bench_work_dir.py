"""`kvmesh bench --work-dir` names a file there as a file, not a folder, before the benchmark starts: it said
"<path>: File exists" once the benchmark began making its folders."""

from __future__ import annotations

import pytest

from kvmesh.deployments.cli import main


@pytest.fixture(autouse=True)
def no_benchmark(monkeypatch):
    """Fails the test if the benchmark starts (it would build a model and start engines)."""

    def prepare(args, routers):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("kvmesh.deployments.cli.bench._prepare", prepare)


@pytest.mark.parametrize("bench", ["peers", "overhead", "kv-probe"])
@pytest.mark.parametrize("under", ["", "sub"])
def test_a_work_dir_that_is_a_file_is_named_as_one(bench, under, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    work = taken / under if under else taken
    assert main(["bench", bench, "--work-dir", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --work-dir" in err, err
    assert f"{taken} is a file, not a folder" in err and "File exists" not in err, err
    assert taken.read_text() == "keep me"

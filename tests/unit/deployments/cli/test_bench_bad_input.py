"""`kvmesh bench` refuses an output folder it cannot write before the benchmark runs (one line, exit 2),
not after it, when its results would be lost."""

from __future__ import annotations

import pytest

from kvmesh.deployments.cli import main


@pytest.fixture(autouse=True)
def no_benchmark(monkeypatch):
    """Fails the test if the benchmark starts (it would build a model and start engines)."""

    def prepare(args, routers):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("kvmesh.deployments.cli.bench._prepare", prepare)


@pytest.mark.parametrize("bench", ["peers", "overhead"])
@pytest.mark.parametrize("under", ["", "sub"])
def test_an_out_dir_that_is_a_file_is_refused_before_the_benchmark(bench, under, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    out = taken / under if under else taken
    assert main(["bench", bench, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --out-dir" in err
    assert (f"{taken} is a file, not a folder" if not under else "cannot be written here") in err
    assert taken.read_text() == "keep me"

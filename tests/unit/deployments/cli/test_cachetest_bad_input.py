"""`kvmesh cachetest` bad input is refused before the test runs (one line, exit 2); a test where every
request failed writes its report and exits 1. Nothing here needs a live server: `discover` is replaced."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from kvmesh.cluster.ports import free_port
from kvmesh.deployments.cli import main
from kvmesh.deployments.replay import MAX_TOKENS_PER_BLOCK


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the cachetest reaches its server."""

    def discover(cfg):
        raise AssertionError("the test ran")

    monkeypatch.setattr("kvmesh.deployments.cachetest.discover", discover)


@pytest.fixture
def served_m(monkeypatch):
    """The server at --url serves model "m" (and is not kvmesh): nothing answers there after that."""
    monkeypatch.setattr("kvmesh.deployments.cachetest.discover", lambda cfg: (["m"], False))


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")


def _log(tmp_path) -> str:
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"body": {"prompt": "hello there", "max_tokens": 2}}) + "\n")
    return str(log)


def _cachetest(*argv: str) -> int:
    return main(["cachetest", "--no-progress", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeout", "0"], "argument --timeout: must be a positive number, got '0'"),
        (["--uncached-rate", "1e308"], "argument --uncached-rate: must be <= 1e+06"),  # a cost of inf
        (
            ["--trace-tokens-per-block", str(MAX_TOKENS_PER_BLOCK + 1)],
            f"argument --trace-tokens-per-block: must be <= {MAX_TOKENS_PER_BLOCK:,}",
        ),
    ],
)
def test_bad_flags_are_refused_before_the_test(argv, message, no_work, tmp_path, capsys):
    rc = _cachetest("--url", "http://x", "--trace", "conversation", "--limit", "1", "--out", str(tmp_path / "o"), *argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("under", ["", "sub"])
def test_an_out_that_is_a_file_is_refused_before_the_test(under, no_work, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    out = taken / under if under else taken
    rc = _cachetest("--url", "http://x", "--requests", _log(tmp_path), "--out", str(out))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "argument --out" in err
    assert (f"{taken} is a file, not a folder" if not under else "cannot be written here") in err
    assert taken.read_text() == "keep me"


def test_a_missing_tokenizer_folder_is_named(served_m, tmp_path, capsys):
    """Not the hub's 'Repo id must use alphanumeric chars': a tokenizer here is a local folder."""
    rc = _cachetest(
        "--url", "http://x", "--requests", _log(tmp_path), "--out", str(tmp_path / "o"), "--tokenizer", "/nonexistent"
    )
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer /nonexistent: no such folder" in err and err.count("\n") == 1


def test_every_request_failing_writes_the_report_and_exits_1(served_m, tiny_model, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request fails to connect
    out = tmp_path / "o"
    rc = _cachetest("--url", url, "--requests", _log(tmp_path), "--out", str(out), "--tokenizer", str(tiny_model))
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    assert report["passes"] and all(p["errors"] == p["requests"] == 1 for p in report["passes"].values())

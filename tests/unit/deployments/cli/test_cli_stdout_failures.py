"""A standard output that cannot be written costs no file and gives one line, not a traceback: `kvmesh simulate`
printed its table before writing --json and --plot (a full disk under PYTHONUNBUFFERED lost both), and the
dispatcher never flushed standard output, so a full disk or a closed pipe surfaced at exit as "Exception
ignored" with status 120. Now a full disk is one error line and status 2, and a reader that has gone (`| head`)
ends the command quietly with status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RECORD = {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 2]}


def _argv(tmp_path, command):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(dict(RECORD, timestamp=i)) + "\n" for i in range(4)))
    out = tmp_path / "out.json"
    if command == "simulate":
        sim = ["--replicas", "2", "--capacity-blocks", "100", "--policies", "round_robin", "--no-progress"]
        return ["simulate", "--trace", str(trace), *sim, "--json", str(out), "--plot", str(tmp_path / "out.png")]
    return ["trace", "bounds", "--trace", str(trace), "--json", str(out)]


def _env(unbuffered: bool) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("PYTHONUNBUFFERED", None)
    return dict(env, PYTHONUNBUFFERED="1") if unbuffered else env


def _written(tmp_path, command):
    assert json.loads((tmp_path / "out.json").read_text())
    if command == "simulate":
        assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("command", ["simulate", "trace bounds"])
def test_a_full_disk_on_standard_output_is_one_line_and_the_files_are_written(tmp_path, command, unbuffered):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "kvmesh.deployments.cli", *_argv(tmp_path, command)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=_env(unbuffered),
        )
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("wrote ")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 1 and errors[0].startswith("error: ") and "No space left on device" in errors[0], errors
    _written(tmp_path, command)


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("command", ["simulate", "trace bounds"])
def test_a_reader_that_has_gone_ends_the_command_quietly(tmp_path, command, unbuffered):
    """As `kvmesh simulate ... | head -0`: the files are written and nothing is said of the pipe."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvmesh.deployments.cli", *_argv(tmp_path, command)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=_env(unbuffered),
        )
    finally:
        os.close(write)
    assert proc.returncode == 1, proc.stderr
    assert all(line.startswith("wrote ") for line in proc.stderr.splitlines()), proc.stderr
    _written(tmp_path, command)

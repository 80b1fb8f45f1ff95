"""How `kvmesh simulate` and `kvmesh trace bounds` read a trace, and what they say of one they cannot use:
`trace bounds` took a trace whose timestamps go back, which `simulate` refuses; a folder given as the trace
was called "no such file"; `simulate --block-size 256` on a trace of 512-token ids did not say that
`--tokens-per-block` is the flag that expands ids into engine blocks; a pipe (`--trace <(zcat t.jsonl.gz)`,
/dev/stdin) or /dev/null was called "no such file", though each reader reads the trace once, line by line."""

from __future__ import annotations

import json
import os

import pytest
from cli_checks import refused

from kvmesh.deployments.cli import main

SIM = ["simulate", "--replicas", "2", "--capacity-blocks", "100", "--policies", "round_robin", "--no-progress"]


def _write(tmp_path, rows):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("command", [SIM, ["trace", "bounds"]], ids=["simulate", "trace bounds"])
def test_a_timestamp_that_goes_back_is_refused_by_both(tmp_path, capsys, command):
    rows = [
        {"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]},
    ]
    err = refused(capsys, *command, "--trace", _write(tmp_path, rows))
    assert "t.jsonl line 2: timestamp 1 goes back in time (previous 5)" in err


@pytest.mark.parametrize("command", [SIM, ["trace", "bounds"]], ids=["simulate", "trace bounds"])
def test_a_folder_given_as_the_trace_is_called_a_folder(tmp_path, capsys, command):
    err = refused(capsys, *command, "--trace", str(tmp_path))
    assert "is a folder, not a trace file" in err and "no such file" not in err, err


def test_a_block_size_the_ids_do_not_fit_names_tokens_per_block(tmp_path, capsys):
    rows = [{"timestamp": 0, "input_length": 4851, "output_length": 1, "hash_ids": list(range(10))}]
    err = refused(capsys, *SIM, "--trace", _write(tmp_path, rows), "--block-size", "256")
    assert "input_length 4851 does not fit 10 hash ids of 256 tokens" in err
    assert "--tokens-per-block 512 --block-size 256" in err, err


ROWS = [
    {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]},
]


def _pipe(rows) -> str:
    """A pipe holding `rows` as JSONL, by the name a shell's `<(...)` gives one (/dev/fd/N), its writing end
    closed."""
    r, w = os.pipe()
    with os.fdopen(w, "w") as fh:
        fh.write("".join(json.dumps(row) + "\n" for row in rows))
    return f"/dev/fd/{r}"


@pytest.mark.parametrize(
    "command",
    [SIM, [*SIM, "--tokens-per-block", "512"], ["trace", "bounds"]],
    ids=["simulate", "simulate --tokens-per-block", "trace bounds"],
)
def test_a_pipe_given_as_the_trace_reads_as_the_file_with_its_lines(tmp_path, capsys, command):
    assert main([*command, "--trace", _write(tmp_path, ROWS)]) == 0
    from_file = capsys.readouterr().out
    pipe = _pipe(ROWS)
    try:
        assert main([*command, "--trace", pipe]) == 0
    finally:
        os.close(int(os.path.basename(pipe)))
    # the same output, the trace named by its file name as a file's is (simulate's first line: trace=3)
    assert capsys.readouterr().out == from_file.replace("trace=t.jsonl ", f"trace={os.path.basename(pipe)} ")
    assert "2 requests" in from_file or "requests=2" in from_file, from_file


@pytest.mark.parametrize("command", [SIM, ["trace", "bounds"]], ids=["simulate", "trace bounds"])
def test_dev_null_as_the_trace_has_no_requests(capsys, command):
    err = refused(capsys, *command, "--trace", os.devnull)
    assert "no requests" in err and "no such file" not in err, err

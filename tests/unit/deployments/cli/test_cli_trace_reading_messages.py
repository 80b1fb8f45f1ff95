"""How `kvmesh simulate` and `kvmesh trace bounds` read a trace, and what they say of one they cannot use:
`trace bounds` took a trace whose timestamps go back, which `simulate` refuses; a folder given as the trace
was called "no such file"; `simulate --block-size 256` on a trace of 512-token ids did not say that
`--tokens-per-block` is the flag that expands ids into engine blocks."""

from __future__ import annotations

import json

import pytest
from cli_checks import refused

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

"""The files `kvmesh simulate` and `kvmesh trace` write are whole or not there: a write that fails part way
(here, past a file-size limit, as a full disk does) leaves an earlier file as it was. Written in place, it was
left cut short: `trace synth --out` a trace whose last line was half a record, `simulate --json` invalid JSON,
`trace bounds --json` an empty file."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

RECORD = {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 2]}
EARLIER = b"earlier, good"
SIM = ["simulate", "--replicas", "2", "--capacity-blocks", "100", "--policies", "all", "--no-progress"]


def _run_limited(argv, limit_bytes):
    """The console entry with files limited to `limit_bytes` (Python ignores SIGXFSZ: a write past the limit
    fails with EFBIG, part of it written)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        [sys.executable, "-m", "kvmesh.deployments.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
        env=dict(os.environ, PYTHONHASHSEED="0"),
    )


@pytest.mark.parametrize(
    "name, argv, limit_bytes",
    [
        ("out.jsonl", ["trace", "synth", "--out"], 4096),  # 64 records: ~10 kB
        ("out.json", [*SIM, "--json"], 4096),  # ten policies: ~30 kB
        ("out.png", [*SIM, "--plot"], 4096),  # ~50 kB
        ("out.json", ["trace", "bounds", "--trace", "t.jsonl", "--json"], 64),  # ~400 bytes
    ],
    ids=["trace synth --out", "simulate --json", "simulate --plot", "trace bounds --json"],
)
def test_a_write_that_fails_part_way_leaves_the_earlier_file(tmp_path, monkeypatch, name, argv, limit_bytes):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(dict(RECORD, timestamp=i)) + "\n" for i in range(4)))
    (tmp_path / name).write_bytes(EARLIER)
    argv = [*argv, name] + (["--trace", "t.jsonl"] if argv[0] == "simulate" else [])
    proc = _run_limited(argv, limit_bytes)
    assert proc.returncode == 2, proc.stderr
    assert "File too large" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / name).read_bytes() == EARLIER
    assert sorted(os.listdir(tmp_path)) == sorted({name, "t.jsonl"})  # no temporary file left

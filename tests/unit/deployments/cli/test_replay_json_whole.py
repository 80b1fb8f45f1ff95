"""`kvmesh replay --json`: the summary is written whole or not at all. A write that failed part way (a full
disk) left the file cut short, replacing an earlier summary with invalid JSON."""

from __future__ import annotations

import errno
import json

from kvmesh.cluster import workloads as wl
from kvmesh.deployments import replay as replay_module
from kvmesh.deployments.cli import main
from kvmesh.deployments.replay import ReplayReport, RequestResult


def test_a_failed_write_leaves_the_earlier_summary_as_it_was(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t.jsonl"
    wl.write_jsonl([{"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]}], trace)
    out = tmp_path / "o.json"
    out.write_text('{"earlier": true}')
    result = RequestResult(0, None, None, 32, 0, 4, 0.01, 0.02, "r0", None)
    monkeypatch.setattr(replay_module, "replay", lambda records, cfg, **kw: ReplayReport([result], 1.0))

    def dump_then_fill_the_disk(obj, fh, **kw):
        fh.write('{"requests": ')
        fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", dump_then_fill_the_disk)
    rc = main(["replay", "--url", "http://127.0.0.1:1", "--trace", str(trace), "--json", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "No space left on device" in err, err
    assert out.read_text() == '{"earlier": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json", "t.jsonl"]  # no temporary file left

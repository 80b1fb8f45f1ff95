"""The Mooncake parent rule on the traces a simulation reads: an id always follows the same parent (per tenant,
as tenants are kept apart), so it names its whole prefix. A trace that repeats an id in one prompt ([7, 7, 7, 8])
or gives an id two parents was accepted, and the simulator's prefix match counted the repeated block as cached
wherever it appeared while the bounds count each id once: a policy reached 0.4997 against an "upper bound" of
0.1666."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.cluster.trace import TraceError, load_trace, read_records
from kvmesh.cluster.workloads import ChatSpec, synth_chat, synth_flood, write_jsonl


def _rec(ts, ids, **extra):
    return {"timestamp": ts, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids, **extra}


def _write(tmp_path, records, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _refused(path) -> list[str]:
    """The messages of both readers a simulation uses: `load_trace` and `read_records(in_time_order=True)`."""
    out = []
    for read in (load_trace, lambda p: read_records(p, in_time_order=True)):
        with pytest.raises(TraceError) as exc:
            read(path)
        out.append(str(exc.value))
    return out


def test_an_id_repeated_in_one_prompt_is_refused_naming_its_line(tmp_path):
    path = _write(tmp_path, [_rec(0, [1, 2]), _rec(1000, [7, 7, 7, 8])])
    for msg in _refused(path):
        assert msg.startswith("t.jsonl line 2: hash id 7 appears twice in one prompt") and "\n" not in msg


def test_an_id_after_two_parents_is_refused_naming_its_line(tmp_path):
    path = _write(tmp_path, [_rec(0, [1, 5]), _rec(1, [3]), _rec(2, [2, 5])])
    for msg in _refused(path):
        assert msg.startswith("t.jsonl line 3: hash id 5 follows id 2 here but id 1 earlier") and "\n" not in msg
    # a first id that followed another before, and one later at a prompt's start
    for msg in _refused(_write(tmp_path, [_rec(0, [1, 5]), _rec(1, [5, 6])], "u.jsonl")):
        assert msg.startswith("u.jsonl line 2: hash id 5 follows the start of a prompt here but id 1 earlier")
    for msg in _refused(_write(tmp_path, [_rec(0, [5]), _rec(1, [1, 5])], "v.jsonl")):
        assert msg.startswith("v.jsonl line 2: hash id 5 follows id 1 here but the start of a prompt earlier")


def test_each_tenant_keeps_the_rule_apart_as_their_blocks_are(tmp_path):
    """Two tenants' equal ids are different blocks (their salts), so each may give an id its own parent; within
    one tenant (1 and "1" are one) the rule holds."""
    ok = [_rec(0, [1, 5], tenant="a"), _rec(1, [2, 5], tenant="b"), _rec(2, [1, 5], tenant="a"), _rec(3, [9, 5])]
    assert len(load_trace(_write(tmp_path, ok))) == 4
    assert len(read_records(_write(tmp_path, ok), in_time_order=True)) == 4
    bad = [_rec(0, [1, 5], tenant=1), _rec(1, [2, 5], tenant="1")]
    for msg in _refused(_write(tmp_path, bad, "b.jsonl")):
        assert msg.startswith("b.jsonl line 2: hash id 5 follows id 2 here but id 1 earlier (tenant '1')")


def test_traces_that_keep_the_rule_read_as_before(tmp_path):
    """The bundled traces, the test fixtures and the generated workloads keep the rule (and a prompt that
    repeats a whole earlier prompt, or a prefix of it, is no breach)."""
    assert len(load_trace("conversation")) == 12031 and len(load_trace("synthetic")) == 3993
    assert len(load_trace("tests/fixtures/pileup-repro.jsonl")) == 96
    recs = synth_chat(ChatSpec(tenants=3, users=3, turns=4)) + synth_flood(20, tenant="t9")
    recs.sort(key=lambda r: r["timestamp"])
    path = tmp_path / "chat.jsonl"
    write_jsonl(recs, path)
    assert len(load_trace(str(path))) == len(recs)
    again = [_rec(0, [1, 2, 3]), _rec(1, [1, 2, 3]), _rec(2, [1, 2]), _rec(3, [1, 2, 3, 4])]
    assert len(load_trace(_write(tmp_path, again))) == 4


def test_kvmesh_simulate_refuses_such_a_trace_in_one_line_exit_2(tmp_path):
    path = _write(tmp_path, [_rec(0, [7, 7, 7, 8]), _rec(1000, [7, 7, 7, 8])])
    for extra in ([], ["--tokens-per-block", "32"]):
        r = subprocess.run(
            [sys.executable, "-m", "kvmesh.deployments.cli", "simulate", "--trace", path, "--replicas", "1"]
            + ["--capacity-blocks", "100", "--policies", "round_robin", "--no-progress", *extra],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == "error: t.jsonl line 1: hash id 7 appears twice in one prompt (an id names " + (
            "its whole prefix, so a prompt holds each id once)"
        )

"""`kvmesh simulate`: the issue-2 JSON shape, the table, the PNG, and one-line errors with exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmesh.deployments.cli import main
from kvmesh.policies.registry import POLICY_NAMES

ENV = dict(os.environ, PYTHONHASHSEED="0")


def _cli(*args):
    """The real console entry (a subprocess), to see exactly what a user sees."""
    return subprocess.run([sys.executable, "-m", "kvmesh.deployments.cli", "simulate", *args], capture_output=True,
                          text=True, timeout=300, env=ENV)


def test_json_shape_table_and_plot(tmp_path, capsys):
    out, png = tmp_path / "o" / "sim.json", tmp_path / "sim.png"
    rc = main(["simulate", "--trace", "conversation", "--replicas", "4", "--capacity-blocks", "500",
               "--limit", "600", "--policies", "all", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {"trace", "replicas", "capacity_blocks", "requests", "bounds", "policies"} <= set(doc)
    assert (doc["trace"], doc["replicas"], doc["capacity_blocks"], doc["requests"]) == ("conversation", 4, 500, 600)
    assert set(doc["bounds"]) == {"global_infinite", "merged_lru"}
    assert list(doc["policies"]) == list(POLICY_NAMES)
    for m in doc["policies"].values():
        for key in ("hit_rate_tokens", "hit_rate_requests", "imbalance", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                    "throughput_tokens_s", "blended_cost"):
            assert isinstance(m[key], float), key
    assert doc["policies"]["kvmesh"]["hit_rate_tokens"] > doc["policies"]["round_robin"]["hit_rate_tokens"]
    table = capsys.readouterr().out
    assert "merged_lru=" in table and all(n in table for n in POLICY_NAMES)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_tiers_load_and_cost_model_options(tmp_path):
    out = tmp_path / "t.json"
    rc = main(["simulate", "--trace", "synthetic", "--replicas", "2", "--capacity-blocks", "100",
               "--host-blocks", "400", "--shared", "--load", "0.9", "--limit", "300", "--policies", "kvmesh",
               "--cost-model", '{"prefill_s_per_token": 0.0002}', "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["load"] == pytest.approx(0.9)
    assert doc["config"]["cost_model"]["prefill_s_per_token"] == 0.0002
    assert "merged_lru_with_host" in doc["bounds"]
    tiers = doc["policies"]["kvmesh"]["hit_tokens_by_tier"]
    assert tiers["host"] + tiers["shared"] > 0


@pytest.mark.parametrize("args,needle", [
    (["--trace", "conversation", "--replicas", "0", "--capacity-blocks", "10"], "--replicas: must be >= 1"),
    (["--trace", "conversation", "--replicas", "two", "--capacity-blocks", "10"], "--replicas"),
    (["--trace", "conversation", "--replicas", "2"], "--capacity-blocks"),
    (["--trace", "nope.jsonl", "--replicas", "2", "--capacity-blocks", "10"], "no such file"),
    (["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--policies", "kvmesh,zzz"],
     "unknown policy 'zzz'"),
    (["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--load", "-1"], "--load"),
    (["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--cost-model", '{"bogus": 1}'],
     "unknown keys"),
    (["--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--plot", "x.jpg"], ".png"),
])
def test_bad_arguments_are_one_line_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_malformed_trace_line_is_reported_with_its_number(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
                 '{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]}\n'
                 '{"timestamp": 2, "input_length": 600, "output_length": 3, "hash_ids": [0, 2}\n')
    r = _cli("--trace", str(p), "--replicas", "2", "--capacity-blocks", "10")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "bad.jsonl line 3" in r.stderr and "not valid JSON" in r.stderr


def test_single_request_trace_has_no_load_and_strict_json(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert main(["simulate", "--trace", "conversation", "--replicas", "2", "--capacity-blocks", "10", "--limit", "1",
                 "--policies", "kvmesh", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert doc["config"]["load"] is None and doc["requests"] == 1
    assert "load=n/a" in capsys.readouterr().out

"""Integration: LMCache tiers on the live Serve path (engine hook, node server actor, router tracker, /metrics).

Runs tests/tiers_live_check.py in a child process so it gets its own Ray and Serve, apart from the
session's shared live app."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_lmcache_tiers_on_the_live_path(tmp_path, tiny_model_dir):
    script = Path(__file__).with_name("tiers_live_check.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never join the session's cluster
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=1500, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    found = json.loads(lines[-1])
    assert "error" not in found, found["error"]
    assert found["cached"][0] == 0 and found["cached"][1] > 0
    # a request placed on the other replica while its prompt was still being computed waited for that
    # prefill and loaded the prompt from LMCache (without the hold it computes it again: 0 cached)
    held = found["held"]
    (first_replica, first_cached), (second_replica, second_cached) = held["placed"]
    assert first_cached == 0 and second_replica != first_replica
    assert second_cached >= 1280
    assert held["held_for_tier"] >= 1 and held["hold_timeouts"] == 0
    # one LMCache server for the node, found by both engines; it answered lookups for the prompt
    report = found["tier_report"]
    assert report["nodes"] == 1 and report["healthy_nodes"] == 1
    assert report["lookup_requested_tokens"] >= 512
    assert report["shared_tier_up"] is True  # the fs L2 folder
    # engines told the router about their tiers; the router recorded the prefills as host/shared blocks
    assert len(found["tier_stats"]) == 2
    for t in found["tier_stats"].values():
        assert t["chunk_blocks"] == 2 and t["shared"] is True and t["host_capacity_blocks"] > 0
    assert found["router_tiers"]["prefills_recorded"] >= 1 and found["router_tiers"]["host_marked"] >= 18
    assert any(line.startswith("kvmesh_tier_hit_tokens_total") for line in found["metrics_lines"])
    assert any(line.startswith("kvmesh_tier_server_healthy") and line.endswith(" 1") for line in found["metrics_lines"])

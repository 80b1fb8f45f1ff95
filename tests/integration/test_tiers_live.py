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
    # prefill and loaded the prompt from LMCache (without the hold it computes it again: 0 cached), whether
    # its own router or the other ingress replica's placed the request computing it
    held = found["held"]
    assert len(held["routers"]) == 2, held
    # (when the guard finds the replicas even, the second joins the first and hits its hbm instead)
    split = crossed = 0
    for first, second in held["pairs"]:
        (first_replica, first_cached, first_router, first_predicted) = first
        (second_replica, second_cached, second_router, second_predicted) = second
        if first_replica == second_replica and first_predicted == second_predicted == 0:
            # both placed before either router knew of the other (on a busy machine the first can lose its
            # 30 ms head start): an even guard put both on one replica, whose engine computed the prompt once
            # and served the other request from those blocks, whichever came first
            assert min(first_cached, second_cached) == 0 and max(first_cached, second_cached) >= 1280, held
            continue
        assert first_cached == 0 and second_cached >= 1280, held
        # the router that held it counted the prefix it waited for: predicted = delivered
        assert first_predicted == 0 and second_predicted == second_cached, held
        assert first_router and second_router, held
        split += second_replica != first_replica
        crossed += second_replica != first_replica and first_router != second_router
    assert split >= 1 and crossed >= 1, held  # a pair split over both fronts and both replicas: held across routers
    assert sum(r["held_for_tier"] for r in held["routers"].values()) >= split, held
    assert all(r["hold_timeouts"] == 0 for r in held["routers"].values()), held
    # each router counts every completed prefill in the tiers, the other router's too
    assert all(t["prefills_recorded"] >= 2 * len(held["pairs"]) for t in held["tiers"].values()), held
    # a prompt that leaves a stored one inside an LMCache chunk loads the whole chunks before that point on
    # the other replica, and the router predicted exactly that (counted block by block it would say 672)
    parted = found["parted"]
    for a_replica, b_replica, b_cached, b_predicted in parted:
        assert b_predicted == b_cached, parted
        assert b_cached == (640 if b_replica != a_replica else 672), parted
    assert any(a != b for a, b, _, _ in parted), parted
    # each engine counts what it loaded through LMCache (vLLM's connector hits): at least every prompt above
    # that came from the tier on the other replica
    from_tier = sum(c for a, b, c, _ in parted if a != b)
    from_tier += sum(second[1] for first, second in held["pairs"] if second[0] != first[0])
    assert sum(found["loaded"].values()) >= from_tier > 0, (found["loaded"], from_tier)
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

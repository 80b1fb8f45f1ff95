"""Integration: kvmesh on a real 2-node Ray cluster (benchmarks/local_cluster.py), deployed onto it as
`kvmesh serve --address` does, with an LMCache server per node and a real redis-server as the shared tier.

Runs tests/integration/multinode_check.py in a child process (a Ray driver of its own cluster, apart from
the session's shared live app) and checks its findings: a node that freezes (SIGSTOP) gets no new requests
once the router holds its replica suspect, its requests in flight are moved to the other node, and it gets
requests back when it resumes, nothing forgotten; a prefix
computed on one node is served on the other from Redis, as the router predicted; a node that leaves and an
LMCache server killed with -9 leave the router's tier view."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_cross_node_shared_tier_hit_and_nodes_leaving(tmp_path):
    script = Path(__file__).with_name("multinode_check.py")
    # the session's local apps leave their Serve settings (HAProxy ports) in this process's environment
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_SERVE_")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-3000:]
    found = json.loads(lines[-1])
    assert "error" not in found, found.get("trace") or found["error"]
    # two Ray nodes, one engine on each, each node with its own LMCache server
    assert found["nodes"] == 2 and len(set(found["engine_nodes"])) == 2
    assert len(found["lmcache_nodes"]) == 2
    # the prefix was computed cold on the worker node, and recorded in that node's host tier
    assert found["first"]["cached"] == 0
    assert any(v["host_blocks"] > 0 for v in found["tier_nodes_before"].values())
    # the worker node froze (every process of it stopped) for 16 s: its replica was suspect within 6 s, and every
    # request sent from then on was answered on the head node at once, not sent to the frozen one to hang
    fz, worker = found["freeze"], found["worker_replica"]
    assert fz["frozen_processes"] >= 3, fz
    assert fz["suspect_at"] is not None and fz["suspect_at"] <= 6.0, fz
    while_suspect = [r for r in fz["requests"] if r["sent"] >= fz["suspect_at"]]
    assert len(while_suspect) >= 2, fz
    for r in while_suspect:
        assert r.get("status") == 200 and r["replica"] != worker and r["latency"] < 5.0, fz
    # those sent to it before: moved to the head node 8 s into the suspicion, answered before the node resumed
    assert all(r.get("status") == 200 for r in fz["requests"]), fz
    assert fz["moved"] >= 1, fz
    for r in fz["requests"]:
        assert r["replica"] != worker and r["sent"] + r["latency"] < fz["resumed_at"], fz
    # /kvmesh/state waited on the frozen node's LMCache server actor once, briefly (before: 5 s every call)
    assert max(fz["state_s"]) < 4.0 and sum(s >= 2.0 for s in fz["state_s"]) <= 1, fz
    # resumed: the suspicion cleared within seconds, its prefix drew its request there again, nothing forgotten
    assert fz["cleared_at"] is not None and fz["cleared_at"] - fz["resumed_at"] <= 3.0, fz
    assert fz["after"] == worker, fz
    assert fz["forgotten_after"] == fz["forgotten_before"] and worker in fz["replicas_after"], fz
    assert fz["suspicions_after"] == fz["suspicions_before"] + 1, fz
    # its LMCache server did not answer the router's tier watch while frozen: its host-tier model was kept aside,
    # not dropped, and read again once the same server answered (before: dropped, the node declared anew, cold)
    before, resumed = fz["tiers_before"], fz["tiers_resumed"]
    assert resumed["nodes_unanswering"] > before["nodes_unanswering"], fz
    assert resumed["nodes_restored"] > before["nodes_restored"], fz
    assert resumed["nodes_dropped"] == before["nodes_dropped"], fz
    assert fz["worker_host_blocks_before"] and fz["worker_host_blocks_resumed"] >= fz["worker_host_blocks_before"], fz
    # the worker node left: its replica and its node left the router's view
    left = found["after_node_left"]
    assert left["replica_forgotten"] and len(left["replicas"]) == 1
    assert len(left["tier_nodes"]) <= 1
    # served on the head node from Redis: a shared-tier hit in the router's score (not in the engine's
    # own cache, not on this node's host tier), predicted == delivered == LMCache's L2 hit counter
    second = found["second"]
    hbm, host, shared = found["second_tiers"]
    assert (hbm, host) == (0, 0) and shared > 0
    assert second["cached"] > 0 and second["predicted"] == second["cached"]
    assert found["head_l2_hit_tokens"] >= second["cached"] - found["block_size"]
    assert found["head_l2_hit_tokens"] > 0
    # the head node's LMCache server killed with -9: its host tier left the router's view
    assert found["head_host_blocks_before_kill"] > 0
    assert found["lmcache_pid_found"] and found["head_dropped_after_kill"]

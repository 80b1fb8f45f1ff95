"""Integration: the local Ray clusters of tests and benchmarks leave nothing behind.

- A node of benchmarks/local_cluster.py ends with the process that started it. Each node runs in a process
  group of its own, so when that process (a test, a benchmark) was killed outright, nothing else ended the
  node: its GCS server and raylet ran on, holding ports and memory. Here a child process starts a one-node
  cluster, is SIGKILLed, and every process of the node's group, and every process seen below the node,
  must be gone shortly after.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

STARTER = """
import json, os, sys, time
import psutil
from kvmesh.benchmarks.local_cluster import LocalRayCluster, NodeSpec

cluster = LocalRayCluster(sys.argv[1], [NodeSpec(1)]).start()
node = cluster.procs[0]
below = [p.pid for p in psutil.Process(node.pid).children(recursive=True)]
print(json.dumps({"pgid": os.getpgid(node.pid), "pids": [node.pid, *below], "temp_dir": cluster.temp_dir}), flush=True)
time.sleep(900)
"""

START_TIMEOUT_S = 400
GONE_WITHIN_S = 30


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The starter's first stdout line, or "" if it exited or said nothing in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            return proc.stdout.readline()
    return ""


def _running(pids: dict[int, float], pgid: int) -> list[str]:
    """The processes of group `pgid`, and those of `pids` (pid -> start time), that still run (zombies aside)."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "name", "create_time", "status"]):
        try:
            in_group = os.getpgid(proc.pid) == pgid
        except OSError:
            continue
        seen = pids.get(proc.pid) == proc.info["create_time"]
        if (in_group or seen) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(f"{proc.info['name']} ({proc.pid})")
    return left


def _start_times(pids: list[int]) -> dict[int, float]:
    import psutil

    times = {}
    for pid in pids:
        try:
            times[pid] = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            continue
    return times


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_same(pids: dict[int, float]) -> None:
    """SIGKILL each of `pids` still running as the same process (its pid not since given to another)."""
    import psutil

    for pid, started in pids.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                proc.kill()
        except psutil.Error:
            continue


def test_a_node_ends_when_the_process_that_started_it_is_killed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_SERVE_")}
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "ray")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    found: dict = {}
    pids: dict[int, float] = {}
    try:
        line = _read_line(starter, START_TIMEOUT_S)
        assert line.startswith("{"), f"the one-node cluster did not start; see {tmp_path / 'ray'}"
        found = json.loads(line)
        pids = _start_times(found["pids"])
        assert _running(pids, found["pgid"]), "the node was not running before its starter was killed"
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while (left := _running(pids, found["pgid"])) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"still running {GONE_WITHIN_S}s after the starter was killed: {', '.join(left)}"
    finally:
        _kill_group(starter.pid)
        if found:
            _kill_group(found["pgid"])
            _kill_same(pids)
            shutil.rmtree(found["temp_dir"], ignore_errors=True)

"""benchmarks/local_cluster.py without starting Ray: a node process ends its whole process group once the
process that started it is gone (also when that happened before the node looked), and each cluster has a
Ray token of its own, in an owner-only file, that its nodes and its first driver use."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest

from kvmesh.benchmarks.local_cluster import STARTER_PID_ENV, LocalRayCluster, NodeSpec, end_with_starter

# A stand-in for a node's `ray start --block`: the watch, then a child in its group (as the GCS server and
# raylet are), both printed, then a long wait
NODE = """
import subprocess, sys, time
from kvmesh.benchmarks.local_cluster import end_with_starter
end_with_starter(poll_s=0.1)
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
time.sleep(60)
"""

# A stand-in for a test that starts a node and is then killed: it prints the node's pid
STARTER = f"""
import os, subprocess, sys, time
node = subprocess.Popen([sys.executable, "-c", {NODE!r}], stdout=subprocess.PIPE, text=True,
                        env={{**os.environ, {STARTER_PID_ENV!r}: str(os.getpid())}}, start_new_session=True)
print(node.pid, node.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running (zombies aside) after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def test_a_node_ends_with_its_group_when_its_starter_is_killed():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    node = 0
    try:
        node, child = (int(x) for x in starter.stdout.readline().split())
        starter.kill()
        starter.wait()
        assert _gone_within([node, child], 10) == [], "the node outlived the process that started it"
    finally:
        starter.kill()
        if node:
            _kill_group(node)


def test_a_node_whose_starter_died_before_it_looked_ends_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = {**os.environ, STARTER_PID_ENV: str(gone.pid)}
    node = subprocess.Popen(
        [sys.executable, "-c", NODE], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert node.wait(timeout=20) == -signal.SIGKILL
    finally:
        _kill_group(node.pid)


def test_without_a_starter_pid_nothing_is_watched(monkeypatch):
    monkeypatch.delenv(STARTER_PID_ENV, raising=False)
    assert end_with_starter() is None


def test_each_cluster_has_its_own_owner_only_token_for_nodes_and_its_first_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a-token-of-the-callers")  # must not override the cluster's
    a, b = (LocalRayCluster(tmp_path / name, [NodeSpec(1)]) for name in "ab")
    try:
        env = a.env()
        assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in env
        assert env["RAY_AUTH_TOKEN_PATH"] == a.auth_token_path != b.auth_token_path
        assert stat.S_IMODE(os.stat(a.auth_token_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(a.temp_dir).st_mode) == 0o700
        assert open(a.auth_token_path).read() != open(b.auth_token_path).read()
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the starter's own settings, put back at the stop
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/the/callers/token")
        a._export_auth_token()
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == a.auth_token_path and "RAY_AUTH_TOKEN" not in os.environ
        assert os.environ["RAY_AUTH_MODE"] == "token"
    finally:
        a.stop()
        b.stop()
    assert not os.path.exists(a.auth_token_path)
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == "/the/callers/token" and os.environ["RAY_AUTH_MODE"] == "disabled"
    assert os.environ["RAY_AUTH_TOKEN"] == "a-token-of-the-callers"


@pytest.mark.parametrize("starter", ["", "not-a-pid"])
def test_a_malformed_starter_pid_is_ignored(monkeypatch, starter):
    monkeypatch.setenv(STARTER_PID_ENV, starter)
    assert end_with_starter() is None

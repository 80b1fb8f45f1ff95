"""benchmarks/local_cluster.py without starting Ray: a node process ends its whole process group once the
process that started it is gone (also when that happened before the node looked)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kvmesh.benchmarks.local_cluster import STARTER_PID_ENV, end_with_starter

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


@pytest.mark.parametrize("starter", ["", "not-a-pid"])
def test_a_malformed_starter_pid_is_ignored(monkeypatch, starter):
    monkeypatch.setenv(STARTER_PID_ENV, starter)
    assert end_with_starter() is None


def test_a_cluster_removes_the_ray_folders_of_starters_that_are_gone(tmp_path, monkeypatch):
    """A cluster whose starter was killed outright (its nodes end with it) left its /tmp/kvrc-* folder, Ray's
    whole session, forever: each cluster's folder is named after its starter, and the next cluster set up
    removes those of starters that are gone. Nothing starts: the folders are made by hand."""
    import shutil
    import tempfile

    from kvmesh.benchmarks import local_cluster
    from kvmesh.kvstore.private_dir import write_owner_tag

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(local_cluster, "TEMP_ROOT", str(tmp_path), raising=False)
    dead = tempfile.mkdtemp(prefix=f"kvrc-{gone.pid}-", dir=tmp_path)  # a cluster whose starter is gone
    live = tempfile.mkdtemp(prefix=f"kvrc-{os.getppid()}-", dir=tmp_path)  # one of a running starter
    for path in (dead, live):
        write_owner_tag(path)
    cluster = local_cluster.LocalRayCluster(tmp_path / "work", [local_cluster.NodeSpec(1)])
    try:
        assert os.path.dirname(cluster.temp_dir) == str(tmp_path), cluster.temp_dir
        assert os.path.basename(cluster.temp_dir).startswith(f"kvrc-{os.getpid()}-"), cluster.temp_dir
        assert not os.path.exists(dead), "a gone starter's cluster folder was not removed"
        assert os.path.isdir(live)
        cluster.stop()
        assert not os.path.exists(cluster.temp_dir)
    finally:
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def _fake_nodes(monkeypatch, tmp_path, scripts: list[str]) -> list[int]:
    """LocalRayCluster._start_node replaced: try k runs `scripts[k]` (sh, its own session as a real node's)
    with {log} and {pidfile} filled in; returns the list the left-behind children's pids are read into."""
    from kvmesh.benchmarks import local_cluster

    tries = []

    def start_node(self, spec, head):
        log = self.workdir / f"ray-node-{len(self.procs)}.log"
        log.write_bytes(b"")
        script = scripts[len(tries)].format(log=log, pidfile=tmp_path / f"child-{len(tries)}.pid")
        tries.append(1)
        self.address = "127.0.0.1:1"
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    monkeypatch.setattr(local_cluster.LocalRayCluster, "_start_node", start_node)
    return tries


def _child(tmp_path, k: int) -> int:
    path = tmp_path / f"child-{k}.pid"
    deadline = time.monotonic() + 10
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def test_a_failed_node_start_leaves_nothing_running(monkeypatch, tmp_path):
    """A `ray start` try that exited was dropped without killing its process group: what it had spawned (a
    GCS server) outlived cluster.stop()."""
    from kvmesh.benchmarks import local_cluster

    tries = _fake_nodes(
        monkeypatch,
        tmp_path,
        [
            "sleep 300 & echo $! > {pidfile}; exit 1",  # a failed try, a child left behind in its group
            "echo 'Ray runtime started' >> {log}; exec sleep 300",
        ],
    )
    cluster = local_cluster.LocalRayCluster(tmp_path / "work", [local_cluster.NodeSpec(1)])
    child = 0
    try:
        cluster.start()
        child = _child(tmp_path, 0)
        assert len(tries) == 2
        cluster.stop()
        assert _gone_within([child], 10) == [], "the failed try's child outlived cluster.stop()"
    finally:
        cluster.stop()
        if child and _gone_within([child], 0):
            os.kill(child, signal.SIGKILL)


def test_stop_ends_the_group_of_a_node_whose_start_command_already_exited(monkeypatch, tmp_path):
    """stop() signalled only the groups whose leader still ran: a node whose `ray start` had exited left its
    children (which keep its group) running."""
    from kvmesh.benchmarks import local_cluster

    _fake_nodes(
        monkeypatch, tmp_path, ["echo 'Ray runtime started' >> {log}; sleep 1; sleep 300 & echo $! > {pidfile}"]
    )
    cluster = local_cluster.LocalRayCluster(tmp_path / "work", [local_cluster.NodeSpec(1)])
    child = 0
    try:
        cluster.start()
        child = _child(tmp_path, 0)
        # started after the node came up (start() saw none), its leader gone since: the child keeps the group
        cluster.procs[0].wait(timeout=10)
        cluster.stop()
        assert _gone_within([child], 10) == [], "the node's child outlived cluster.stop()"
    finally:
        cluster.stop()
        if child and _gone_within([child], 0):
            os.kill(child, signal.SIGKILL)


def test_stop_leaves_alone_a_group_whose_number_went_to_another_process(tmp_path):
    """A node whose `ray start` exited, its group emptied since: its number is a free pid, and a process that
    got it (here a session leader of its own) was signalled and killed by stop()."""
    from kvmesh.benchmarks import local_cluster

    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)

    class ExitedLeader:  # the node's `ray start`, exited and reaped, its pid since given to `unrelated`
        pid = unrelated.pid
        returncode = 1

        def poll(self) -> int:
            return 1

        def wait(self, timeout: float | None = None) -> int:
            return 1

    cluster = local_cluster.LocalRayCluster(tmp_path / "work", [local_cluster.NodeSpec(1)])
    cluster.procs = [ExitedLeader()]  # type: ignore[list-item]
    try:
        cluster.stop()
        assert unrelated.poll() is None, "stop() killed a process that only had the exited node's pid"
    finally:
        unrelated.kill()
        unrelated.wait()

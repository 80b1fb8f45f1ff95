"""A child asked to die with its parent also dies when that parent died before it could ask: after the
parent-death prctl, the child compares its parent with the pid of the process that started it (taken
before the fork) and ends itself if they differ. Covers process_tree.die_with_parent (the `kvmesh serve`
driver) and the HAProxy launcher of local runs (deployments/loopback_haproxy.py), whose orphan kept the
HTTP port. The parent's early death is staged by naming another process as the starter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvmesh.deployments import process_tree
from kvmesh.deployments.loopback_haproxy import write_launcher

PARENT_PID_ENV = "KVMESH_HAPROXY_PARENT_PID"  # how the launcher script hands its $PPID to the launcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


def _gone_pid() -> int:
    """The pid of a process that has exited: the starter that died before its child's prctl."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _ended_within(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def test_a_child_whose_starter_died_before_the_prctl_ends_itself(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", _gone_pid)  # the pid die_with_parent takes as the starter's
        preexec = process_tree.die_with_parent()
    child = subprocess.Popen(["sleep", "30"], preexec_fn=preexec)
    assert _ended_within(child, 10) == -signal.SIGKILL, "an orphan outlived its dead starter"


def test_a_child_whose_starter_lives_runs_its_program():
    child = subprocess.Popen(["sh", "-c", "exit 3"], preexec_fn=process_tree.die_with_parent())
    assert _ended_within(child, 10) == 3


def test_the_haproxy_launcher_ends_when_its_parent_died_before_the_prctl():
    env = {**os.environ, PARENT_PID_ENV: str(_gone_pid())}
    cmd = [sys.executable, "-m", "kvmesh.deployments.loopback_haproxy", "/bin/sleep", "1", "2", "30"]
    launcher = subprocess.Popen(cmd, env=env)
    assert _ended_within(launcher, 20) == -signal.SIGKILL, "an orphaned HAProxy would have kept running"


def test_the_haproxy_launcher_script_passes_its_parent_and_runs_the_real_binary(tmp_path):
    script = write_launcher(str(tmp_path), "/bin/sh", 18404, 19101)
    assert "$PPID" in open(script).read()
    # the real binary gets HAProxy's arguments (here a shell's), and not the launcher's variable
    ran = subprocess.run(
        [script, "-c", f'test -z "${PARENT_PID_ENV}" && exit 3'], timeout=20, capture_output=True, text=True
    )
    assert ran.returncode == 3, ran.stderr

"""Integration: the local Ray clusters of tests and runs leave nothing behind and let no one else in.

- A node of benchmarks/local_cluster.py ends with the process that started it. Each node runs in a process
  group of its own, so when that process (a test, a benchmark) was killed outright, nothing else ended the
  node: its GCS server and raylet ran on, holding ports and memory. Here a child process starts a one-node
  cluster, is SIGKILLed, and every process of the node's group, and every process seen below the node,
  must be gone shortly after.
- Such a cluster requires its own token: a driver without it, or with another, is refused.
- The Ray token of a local run (deployments/local_ray.py) is readable by its owner only.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
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


DRIVER = """
import ray
from kvmesh.deployments.ray_join import join_cluster
join_cluster({address!r})
print("joined", len(ray.nodes()))
"""


def _join(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = DRIVER.format(address=address)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


def test_a_driver_without_the_clusters_token_is_refused(tmp_path):
    from kvmesh.benchmarks.local_cluster import LocalRayCluster, NodeSpec

    saved = dict(os.environ)  # the starting process becomes the cluster's first driver: it gets the token
    cluster = LocalRayCluster(tmp_path / "ray", [NodeSpec(1)])
    try:
        cluster.start()
        member = cluster.env()
        # another local user: no way to read the token file, so no token, or a guessed one, or auth turned off
        outsider = {k: v for k, v in member.items() if k != "RAY_AUTH_TOKEN_PATH"}
        outsider["HOME"] = str(tmp_path / "outsider")  # no ~/.ray/auth_token of this user's either
        for env in (outsider, {**outsider, "RAY_AUTH_TOKEN": "0" * 64}, {**outsider, "RAY_AUTH_MODE": "disabled"}):
            refused = _join(cluster.address, env)
            assert refused.returncode != 0 and "joined" not in refused.stdout, refused.stdout
        joined = _join(cluster.address, member)
        assert joined.returncode == 0 and "joined 1" in joined.stdout, joined.stderr[-2000:]
        token = member["RAY_AUTH_TOKEN_PATH"]
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == token and stat.S_IMODE(os.stat(token).st_mode) == 0o600
    finally:
        cluster.stop()
        os.environ.clear()
        os.environ.update(saved)


LOCAL_RUN = """
import json, os, sys
os.umask(0o022)  # the usual umask: a file Ray writes without choosing its mode is readable by everyone
import ray
from kvmesh.deployments import local_ray

local_ray.start_local_ray(num_cpus=1, env_vars={}, log_to_driver=False)
named = os.environ.get("RAY_AUTH_TOKEN_PATH")
default = os.path.expanduser("~/.ray/auth_token")
modes = {p: oct(os.stat(p).st_mode & 0o777) for p in (named, default) if p and os.path.exists(p)}
ray.shutdown()
getattr(local_ray, "remove_auth_token_file", lambda: None)()
print(json.dumps({"named": named, "modes": modes, "left": [p for p in modes if os.path.exists(p)]}), flush=True)
"""


def test_a_local_runs_ray_token_is_owner_only_and_removed_at_the_end(tmp_path):
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="kvrt-", dir="/tmp")  # Ray's socket paths must stay short
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "KVMESH_HOME")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("RAY_SERVE_")}
    env.update(HOME=str(tmp_path / "user"), KVMESH_HOME=str(tmp_path / "kvmesh"), RAY_TMPDIR=ray_tmp)
    run = subprocess.Popen(
        [sys.executable, "-c", LOCAL_RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = run.communicate(timeout=START_TIMEOUT_S)
    finally:
        _kill_group(run.pid)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-3000:]
    found = json.loads(lines[-1])
    assert found["modes"], "no Ray token file was found"
    assert all(mode == "0o600" for mode in found["modes"].values()), found["modes"]
    assert found["named"] and found["named"].startswith(str(tmp_path / "kvmesh" / "run"))
    assert not found["left"], f"token file(s) left after the run: {found['left']}"

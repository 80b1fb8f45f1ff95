"""A real multi-node Ray cluster on this machine, for the multi-node tests and the scale benchmark.

Each node is its own `ray start --block` process (own raylet, object store and worker pool) in its own
process group, on 127.0.0.1, with its own CPU count and custom resources, so Ray schedules across
nodes exactly as on a real cluster. `stop_node(i)` kills one node's whole process group (raylet
included, SIGKILL): the node leaves as a crashed machine would. `stop()` ends every process the
cluster started, found by pid, never by name (`ray stop` would end every Ray on the machine). A node
also ends by itself when the process that started it is gone, even one killed outright
(`end_with_starter`): its own process group kept its GCS server and raylet running otherwise.

    with LocalRayCluster(workdir, [NodeSpec(1, {"kvmesh_engine": 1}), NodeSpec(0, {"kvmesh_engine": 1})]) as c:
        start_local(cfg, address=c.address)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvmesh.cluster.ports import free_ports
from kvmesh.deployments.config import INPROC_ENGINE_ENV, SERVE_PATH_ENV
from kvmesh.kvstore.private_dir import owned_temp_dir, remove_dead_owners_dirs

LOOPBACK = "127.0.0.1"
TEMP_ROOT = "/tmp"
TEMP_PREFIX = "kvrc-"  # a cluster's Ray folder: /tmp/kvrc-<starter pid>-XXXXXXXX
# Every node's environment, as an operator's cluster would set it (k8s/rayservice.yaml): Serve's
# request-path settings; token authentication off (Ray 2.60 turns it on for clusters it starts, and every
# node and driver must agree); Serve's own proxy (HAProxy's stats and metrics ports are per machine, and
# every node here is on this one)
CLUSTER_ENV = {
    **INPROC_ENGINE_ENV,
    **SERVE_PATH_ENV,
    "RAY_AUTH_MODE": "disabled",
    "RAY_raylet_start_wait_time_s": "150",
    "RAY_SERVE_ENABLE_HA_PROXY": "0",
}


# `ray start` for a node on 127.0.0.1 (deployments/ray_join.py: Ray would rewrite the address), and patient:
# Ray gives a new raylet 30 s to appear in the GCS, which a machine busy with engines can miss
RAY_START = """
import sys
from kvmesh.benchmarks.local_cluster import end_with_starter, patient_node_start
end_with_starter()
from kvmesh.deployments.ray_join import keep_loopback
from ray.scripts.scripts import main

patient_node_start()
with keep_loopback():
    sys.argv[0] = "ray"
    main()
"""


# The pid of the process that started a node, as the node's `ray start` sees it (end_with_starter)
STARTER_PID_ENV = "KVMESH_NODE_STARTER_PID"
STARTER_POLL_S = 0.5
# How long stop() gives the nodes to end on SIGTERM before it kills what is left: the head's GCS takes about
# 30 s to exit on SIGTERM (workers end within a second), and nothing of a stopped test or bench cluster is kept.
STOP_GRACE_S = 5.0


def end_with_starter(poll_s: float = STARTER_POLL_S) -> threading.Thread | None:
    """Watch, from a daemon thread, that this node's starter (STARTER_PID_ENV) is still this process's
    parent, and SIGKILL this process's group (the node's GCS and raylet are in it) once it is not.

    Why: a node runs in a process group of its own, so nothing ends it when the process that started it is
    killed outright; its GCS server and raylet then ran on and ignored SIGTERM. The parent is compared with
    the pid the starter passed down, not with the parent seen at start: a starter that died before this
    thread ran is noticed on the first look. Returns the thread, or None without a starter pid."""
    starter = os.environ.get(STARTER_PID_ENV, "")
    if not starter.isdigit():
        return None

    def watch() -> None:
        while os.getppid() == int(starter):
            time.sleep(poll_s)
        end_own_group()

    thread = threading.Thread(target=watch, name="end-with-starter", daemon=True)
    thread.start()
    return thread


def end_own_group() -> None:
    """SIGKILL this process's group when this process leads it (a node's `ray start`), else this process only:
    never a group it merely belongs to (a caller's shell or test runner)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def patient_node_start(wait_s: float = 150.0) -> None:
    """Give a starting Ray node `wait_s` instead of Ray's fixed 30 s to appear in the GCS (this process's
    `ray start` or `ray.init` only): on a machine busy with engines the raylet registers late, and Ray
    would abandon a node that is about to work."""
    from kvmesh.deployments import ray_private

    # the raylets this process starts wait as long for their agents' ports (Ray's default is a few seconds)
    os.environ.setdefault("RAY_raylet_start_wait_time_s", str(int(wait_s)))
    get_node = ray_private.get_node_function()
    if getattr(get_node, "patient", False):
        return

    def patient_get_node(gcs_address, node_id):
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    patient_get_node.patient = True  # type: ignore[attr-defined]
    ray_private.set_get_node_function(patient_get_node)


@dataclasses.dataclass
class NodeSpec:
    num_cpus: int
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)


class LocalRayCluster:
    """Head = node 0, the others join it. Every port is picked free, so clusters can run side by side."""

    def __init__(self, workdir: str | os.PathLike, nodes: Sequence[NodeSpec], start_timeout_s: float = 300.0):
        if not nodes:
            raise ValueError("a cluster needs at least the head node")
        self.workdir = Path(workdir)
        self.nodes = list(nodes)
        self.start_timeout_s = start_timeout_s
        # Ray's socket paths must stay under 107 bytes: a short folder of its own under /tmp, named after this
        # process: a cluster whose starter was killed outright (its nodes end with it, end_with_starter) could
        # not remove its folder, and the next cluster set up removes those of starters that are gone
        remove_dead_owners_dirs(TEMP_PREFIX, TEMP_ROOT)
        self.temp_dir = owned_temp_dir(TEMP_PREFIX, TEMP_ROOT)
        self.address = ""
        self.procs: list[subprocess.Popen | None] = []
        self._seen: dict[int, float] = {}  # pid -> start time of every process seen below a node, for stop()

    def env(self) -> dict[str, str]:
        """The environment of every node, and the one a driver joining the cluster needs."""
        # a local run's Serve settings (HAProxy files and ports) would be shared by every node here
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_SERVE_")}
        env.update(CLUSTER_ENV)
        return env

    def _start_node(self, spec: NodeSpec, head: bool) -> subprocess.Popen:
        ports = free_ports(9)
        cmd = [sys.executable, "-c", RAY_START, "start", "--block", "--node-ip-address", LOOPBACK]
        cmd += ["--num-cpus", str(spec.num_cpus)]
        cmd += ["--resources", json.dumps(dict(spec.resources)), "--disable-usage-stats"]
        cmd += ["--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1])]
        cmd += ["--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3])]
        cmd += ["--runtime-env-agent-port", str(ports[4]), "--metrics-export-port", str(ports[5])]
        cmd += ["--object-store-memory", str(200 * 1024 * 1024)]
        if head:
            gcs = ports[6]
            cmd += ["--head", "--port", str(gcs), "--include-dashboard", "false", "--temp-dir", self.temp_dir]
            cmd += ["--ray-client-server-port", str(ports[7])]
            self.address = f"{LOOPBACK}:{gcs}"
        else:
            cmd += ["--address", self.address]
        env = {**self.env(), STARTER_PID_ENV: str(os.getpid())}  # the node ends with this process (end_with_starter)
        with open(self.workdir / f"ray-node-{len(self.procs)}.log", "wb") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self) -> LocalRayCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i, spec in enumerate(self.nodes):
                for attempt in range(3):  # a node that still failed to start (see RAY_START) gets another try
                    self.procs.append(self._start_node(spec, head=i == 0))
                    if self._wait_started(i):
                        break
                    self._end_failed_try(self.procs.pop())
                    if attempt == 2:
                        raise RuntimeError(f"ray node {i} did not start; see {self.workdir}/ray-node-{i}.log")
            self._remember_pids()
        except BaseException:
            self.stop()
            raise
        return self

    def _end_failed_try(self, p: subprocess.Popen | None) -> None:
        """A `ray start` that exited without starting its node may have left what it spawned (a GCS server, a
        raylet) in its process group: remember them for stop() and kill the group now."""
        if p is None:
            return
        self._remember_group(p.pid)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing left in the group
        p.wait(timeout=30)

    def _remember_group(self, pgid: int) -> None:
        """Every process in group `pgid` (its leader may be gone: children keep the group), for stop()."""
        import psutil

        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == pgid:
                    self._seen[proc.pid] = proc.create_time()
            except (OSError, psutil.Error):  # gone meanwhile
                continue

    def add_node(self, spec: NodeSpec) -> int:
        """Join one more node to the running cluster (as a cluster autoscaler adds one); returns its index."""
        self.nodes.append(spec)
        self.procs.append(self._start_node(spec, head=False))
        i = len(self.procs) - 1
        if not self._wait_started(i):
            raise RuntimeError(f"ray node {i} did not start; see {self.workdir}/ray-node-{i}.log")
        self._remember_pids()
        return i

    def _wait_started(self, i: int) -> bool:
        """True once node i's `ray start` says the node runs (it waits for the node's GCS registration);
        False when it exited instead."""
        log = self.workdir / f"ray-node-{i}.log"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if b"Ray runtime started" in log.read_bytes():
                return True
            if self.procs[i] is None or self.procs[i].poll() is not None:  # type: ignore[union-attr]
                return False
            time.sleep(0.5)
        raise TimeoutError(f"ray node {i} did not start in {self.start_timeout_s:.0f}s; see {log}")

    def _check_procs(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"ray node {i} exited ({p.returncode}); see {self.workdir}/ray-node-{i}.log")

    def wait_nodes(self, n: int) -> list[dict]:
        """Wait until n nodes are alive; return them as Ray's GCS lists them. Asked from a short-lived
        child process, so the caller does not become a Ray driver of this cluster. RuntimeError when a
        node process exited meanwhile."""
        code = (
            "import json, time, ray\n"
            "from kvmesh.deployments.ray_join import join_cluster\n"
            f"join_cluster({self.address!r})\n"
            f"deadline = time.monotonic() + {self.start_timeout_s}\n"
            f"pids = {[p.pid for p in self.procs if p is not None]}\n"
            "def dead(pid):\n"
            "    try:\n"
            "        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] in 'ZX'\n"
            "    except OSError:\n"
            "        return True\n"
            "while True:\n"
            "    alive = [x for x in ray.nodes() if x['Alive']]\n"
            "    gone = any(dead(p) for p in pids)\n"
            f"    if len(alive) >= {n} or gone or time.monotonic() > deadline:\n"
            "        print(json.dumps(alive)); break\n"
            "    time.sleep(0.5)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=self.start_timeout_s + 60,
        )
        self._check_procs()
        lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
        alive = json.loads(lines[-1]) if lines else []
        if len(alive) < n:
            raise TimeoutError(f"the local Ray cluster has {len(alive)} of {n} nodes: {proc.stderr[-500:]}")
        self._remember_pids()
        return alive

    def _remember_pids(self) -> None:
        import psutil  # Ray's own dependency

        for p in self.procs:
            if p is None or p.poll() is not None:  # exited and reaped: its pid may be another process's now
                continue
            try:
                top = psutil.Process(p.pid)
                for proc in [top, *top.children(recursive=True)]:
                    self._seen[proc.pid] = proc.create_time()
            except psutil.NoSuchProcess:
                continue

    def stop_node(self, i: int) -> None:
        """Kill node i (not the head) for real: SIGKILL to its whole process group, raylet included."""
        if i == 0:
            raise ValueError("node 0 is the head: stopping it ends the cluster")
        self._remember_pids()
        p = self.procs[i]
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
        self.procs[i] = None

    def stop(self) -> None:
        """End every node (workers first, then the head) and every process seen below them."""
        import psutil

        self._remember_pids()
        for p in reversed(self.procs):
            if p is not None and (p.poll() is None or not psutil.pid_exists(p.pid)):
                # also where the node's `ray start` itself has exited: what it started keeps its group, and
                # keeps its number from being reused while any of it runs. Where a process now has that pid the
                # number was free and went to another (a group of its own, not this node's): left alone
                self._remember_group(p.pid)
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for p in reversed(self.procs):
            if p is not None:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._remember_pids()
        for pid, started in sorted(self._seen.items()):
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == started:  # the same process, not a later one given its pid
                    proc.kill()
            except psutil.NoSuchProcess:
                continue
        for p in self.procs:  # reaped: a killed `ray start` is this process's child
            if p is not None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.procs = []
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

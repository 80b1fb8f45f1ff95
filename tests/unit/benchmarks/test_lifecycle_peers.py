"""The peer benchmark's processes (benchmarks/peers/): the KV events a bare vLLM server publishes for a
TCP-subscribing peer are bound on loopback only, and every process it starts ends with the process that
started it, even one killed outright."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from kvmesh.cluster.ports import free_port


def _tcp_binds(monkeypatch, tmp_path) -> list[tuple[str, str]]:
    """(the publisher's bind endpoint, the subscribers' endpoint) of each server a TCP run starts."""
    from kvmesh.benchmarks.peers import engines, procs

    started = []
    monkeypatch.setattr(procs, "start", lambda name, cmd, log_dir, env: started.append(cmd) or cmd)
    monkeypatch.setattr(procs, "wait_ready", lambda *a, **k: None)
    servers = engines.start_servers(2, engines.EngineSpec(model="m"), tmp_path, kv_events_tcp=True)
    binds = [json.loads(cmd[cmd.index("--kv-events-config") + 1])["endpoint"] for cmd in started]
    pairs = [(bind, s.kv_endpoint) for bind, s in zip(binds, servers)]
    monkeypatch.setattr(procs, "stop_all", lambda ps: None)
    engines.stop_servers(servers)
    return pairs


def test_a_tcp_run_binds_each_servers_kv_events_on_loopback_only(monkeypatch, tmp_path):
    for bind, endpoint in _tcp_binds(monkeypatch, tmp_path):
        assert "*" in bind or "::" in bind  # what makes vLLM's publisher bind rather than connect
        pub = zmq.Context.instance().socket(zmq.PUB)
        try:
            pub.bind(bind)
            bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        finally:
            pub.close(linger=0)
        port = endpoint.rsplit(":", 1)[1]
        assert bound == f"tcp://127.0.0.1:{port}" == endpoint, f"{bind} bound {bound}: not loopback only"


def test_vllms_publisher_binds_the_loopback_endpoint_and_a_local_subscriber_gets_events():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import psutil

    from kvmesh.benchmarks.peers.engines import tcp_kv_endpoints

    bind, endpoint = tcp_kv_endpoints(free_port())
    publisher = kv_events.ZmqEventPublisher(0, endpoint=bind)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        deadline, got = time.monotonic() + 20, None
        while got is None and time.monotonic() < deadline:  # a SUB misses what is sent before it joined
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=[]))
            if sub.poll(200):
                got = sub.recv_multipart()
        assert got is not None, "no event reached a subscriber on loopback"
        port = int(endpoint.rsplit(":", 1)[1])
        listening = [c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.laddr.port == port]
        assert "127.0.0.1" in listening and not set(listening) - {"127.0.0.1"}, listening
    finally:
        sub.close(linger=0)
        publisher.shutdown()


STARTER = """
import sys
from pathlib import Path
from kvmesh.benchmarks.peers import procs

proc = procs.start("sleeper", ["sleep", "60"], Path(sys.argv[1]))
print(proc.popen.pid, flush=True)
proc.popen.wait()
"""


def test_a_started_process_ends_when_the_benchmark_is_killed(tmp_path):
    import psutil

    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = None
    try:
        child = psutil.Process(int(starter.stdout.readline()))
        starter.kill()
        starter.wait(timeout=10)
        _, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, "a peer-benchmark process outlived the benchmark that started it"
    finally:
        starter.kill()
        if child is not None and child.is_running():
            os.killpg(child.pid, signal.SIGKILL)  # its own group (start_new_session)


def _fake_overhead_run(monkeypatch, tmp_path) -> dict:
    """bench_overhead with its servers, router, app and HTTP faked; what start_local saw of RAY_TMPDIR."""
    import tempfile

    import httpx

    import kvmesh.deployments.app as app
    import kvmesh.deployments.tiny_model as tiny_model
    from kvmesh.benchmarks.peers import engines, overhead, setups

    class Stoppable:
        def stop(self):
            pass

    seen = {}

    def start_local(config, **kwargs):
        seen["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR")
        return "http://127.0.0.1:9"

    def build(path, *a, **k):
        os.makedirs(path)
        return path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "out"))
    monkeypatch.setattr(tiny_model, "build_tiny_model", build)
    monkeypatch.setattr(engines, "start_servers", lambda n, spec, work: [type("S", (), {"url": "u"})()] * n)
    monkeypatch.setattr(engines, "stop_servers", lambda servers: None)
    monkeypatch.setattr(setups, "start_router", lambda *a, **k: (Stoppable(), "http://127.0.0.1:8", None))
    monkeypatch.setattr(
        overhead, "measure_interleaved", lambda paths, n, **k: {p: [0.004 + i * 1e-5 for i in range(n)] for p in paths}
    )
    monkeypatch.setattr(app, "start_local", start_local)
    monkeypatch.setattr(app, "stop_local", lambda *a, **k: None)
    monkeypatch.setattr(httpx, "get", lambda *a, **k: type("R", (), {"text": ""})())
    return seen


@pytest.mark.parametrize("caller_ray_tmpdir", [None, "/somewhere/ray"])
def test_the_overhead_bench_removes_its_work_dir_and_puts_ray_tmpdir_back(monkeypatch, tmp_path, caller_ray_tmpdir):
    """The work dir (tiny model, logs, Ray's session folder) stayed behind, and RAY_TMPDIR kept pointing into
    it for every later bench of the same `make bench` process."""
    from kvmesh.benchmarks import bench_overhead

    seen = _fake_overhead_run(monkeypatch, tmp_path)
    if caller_ray_tmpdir is None:
        monkeypatch.delenv("RAY_TMPDIR", raising=False)
    else:
        monkeypatch.setenv("RAY_TMPDIR", caller_ray_tmpdir)
    monkeypatch.setenv("BENCH_OVERHEAD_REQUESTS", "5")
    bench_overhead.main()
    if caller_ray_tmpdir is None:
        assert seen["RAY_TMPDIR"] and "kvmesh-overhead-" in seen["RAY_TMPDIR"]  # the app's session went there
    else:
        assert seen["RAY_TMPDIR"] == caller_ray_tmpdir
    assert os.environ.get("RAY_TMPDIR") == caller_ray_tmpdir
    assert not list(tmp_path.glob("kvmesh-overhead-*"))


@pytest.mark.parametrize("given", [False, True])
def test_the_engine_socket_inventory_leaves_no_channel_secret_behind(monkeypatch, tmp_path, given):
    """socket_inventory --engine wrote a channel secret into a fresh temp folder and left both the folder and
    this process's variable pointing at it. One given by the caller is theirs: kept. The engine is faked."""
    import tempfile
    import types

    from kvmesh.benchmarks.socket_inventory import measure_engine
    from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV

    seen = {}

    class FakeReplica:
        def __init__(self, cfg):
            seen["secret"] = os.environ.get(CHANNEL_SECRET_FILE_ENV)
            self.kv_events_endpoint = self.replay_endpoint = None
            self._private_dir = None
            self.driver = types.SimpleNamespace(shutdown=lambda: None)

        def _release(self):
            pass

    engine = types.ModuleType("kvmesh.deployments.engine")
    engine.EngineReplica = FakeReplica  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvmesh.deployments.engine", engine)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if given:
        monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, "/their/secret")
    else:  # set first, so the test's end puts back the caller's value whatever measure_engine left
        monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, "unset")
        monkeypatch.delenv(CHANNEL_SECRET_FILE_ENV)
    assert measure_engine() == []
    if given:
        assert seen["secret"] == os.environ.get(CHANNEL_SECRET_FILE_ENV) == "/their/secret"
    else:
        assert seen["secret"] and os.path.basename(os.path.dirname(seen["secret"])).startswith("kvmesh-inventory-")
        assert os.environ.get(CHANNEL_SECRET_FILE_ENV) is None
    assert not list(tmp_path.glob("kvmesh-inventory-*"))

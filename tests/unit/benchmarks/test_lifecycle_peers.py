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

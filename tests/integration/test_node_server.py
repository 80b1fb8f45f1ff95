"""Integration: the per-node LMCache server owner (in-process core and as a Ray actor), real servers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvmesh.kvstore.lmcache_server import port_open
from kvmesh.kvstore.tiers import TierConfigError

pytestmark = pytest.mark.integration


def _cfg(tmp_path, **over):
    return {
        "l1_size_gb": 0.05,
        "chunk_size": 64,
        "l2": "fs",
        "l2_path": str(tmp_path / "l2"),
        "start_timeout_s": 300,
        **over,
    }


def test_core_watchdog_restarts_a_dead_server(tmp_path):
    from kvmesh.kvstore.node_server import NodeServerCore

    core = NodeServerCore(_cfg(tmp_path, watch_interval_s=0.5), str(tmp_path))
    try:
        host, port = core.endpoint()
        h = core.health()
        assert h["healthy"] and h["shared_tier"] == "fs" and h["shared_tier_up"] is True
        os.killpg(core.server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (core.server.restarts == 1 and core.health()["healthy"]):
            time.sleep(1)
        assert core.server.restarts == 1 and core.health()["healthy"]
        assert core.endpoint() == (host, port)  # same endpoint: engines reconnect without new config
    finally:
        core.stop()
    assert not port_open(host, port)


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    from kvmesh.benchmarks.local_cluster import patient_node_start

    started = not ray.is_initialized()
    if started:
        tmp = tmp_path_factory.mktemp("ray")
        os.environ.setdefault("RAY_TMPDIR", str(tmp))
        patient_node_start()  # beside the other lane's engines starting, Ray's fixed 30 s has run out
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(tmp))
    yield ray
    from kvmesh.kvstore.node_server import stop_node_servers

    stop_node_servers()
    if started:
        ray.shutdown()


def test_one_server_per_node_found_by_every_engine(ray_local, tmp_path):
    from kvmesh.kvstore import node_server
    from kvmesh.kvstore.node_server import engine_lmcache

    cfg = _cfg(tmp_path)
    first = node_server.connect_node_server(cfg).endpoint
    assert node_server.connect_node_server(cfg).endpoint == first  # get-or-create: the same server
    node_id = ray_local.get_runtime_context().get_node_id()
    assert list(node_server.node_servers()) == [node_id]
    kv, _ = engine_lmcache(cfg, block_size=32)
    extra = kv["kv_connector_extra_config"]
    # the node's server on an ipc socket in an owner-only folder: no other user of the machine reaches it
    assert (extra["lmcache.mp.host"], extra["lmcache.mp.port"]) == (first[0], first[1])
    assert first[0].startswith("ipc://")

    status = node_server.tier_status()
    assert status[node_id]["health"]["healthy"] is True
    assert status[node_id]["tiers"]["host_hit_tokens"] == 0

    with pytest.raises(TierConfigError, match="already runs"):
        node_server.connect_node_server({**cfg, "chunk_size": 128})
    with pytest.raises(TierConfigError, match="multiple"):
        engine_lmcache(cfg, block_size=96)

    assert node_server.stop_node_servers() == 1
    deadline = time.monotonic() + 30
    while port_open(*first) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not port_open(*first)
    assert node_server.node_servers() == {}

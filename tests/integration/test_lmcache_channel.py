"""Integration: a real LMCache server listens on no TCP port, other local users cannot open its sockets, and a real
engine still stores to it and loads from it through its ipc socket.

Why: LMCache 0.5.6's request server has no authentication, and its engine-driven transfer path unpickles what
a client sends. Listening on 127.0.0.1, it let any local user run code as kvmesh's user and read or clear every
tenant's KV. Its sockets are now unix sockets in a 0700 folder of the server's owner (docs/security.md).
"""

from __future__ import annotations

import errno
import os
import pwd
import random
import socket
import time

import pytest

from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.probe_engine import EngineProcess, stop_engines
from kvmesh.kvstore.tiers import TierConfig

pytestmark = pytest.mark.integration

BLOCK = 32


def _inet_sockets(pid: int) -> list:
    """Every TCP/UDP socket of a process and its descendants (a listener would be among them)."""
    import psutil

    root = psutil.Process(pid)
    return [c for p in [root, *root.children(recursive=True)] for c in p.net_connections(kind="inet")]


def _connect_as(uid: int, gid: int, path: str) -> int:
    """The errno a process of another user gets connecting to the unix socket `path` (0: it connected)."""
    pid = os.fork()
    if pid == 0:  # the child only switches user and connects: nothing that could need another thread's lock
        code = 0
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
        except OSError as exc:
            code = exc.errno or 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _reset(engine: EngineProcess, within_s: float = 60) -> None:
    """vLLM refuses while blocks are held, and a block stays held until LMCache has stored it."""
    deadline = time.monotonic() + within_s
    while not engine.reset_prefix_cache():
        assert time.monotonic() < deadline, "the engine kept its blocks: a store never finished"
        time.sleep(0.2)


def test_the_server_has_no_tcp_port_only_its_user_opens_its_sockets_and_engines_load_through_them(
    tiny_model_dir, tmp_path
):
    cfg = TierConfig.from_dict({"l1_size_gb": 0.05, "chunk_size": BLOCK, "start_timeout_s": 300})
    server = LMCacheServer(cfg, tmp_path / "lmcache.log")
    server.start()
    engine = None
    try:
        assert _inet_sockets(server.proc.pid) == []  # neither the request port nor the metrics port
        from kvmesh.kvstore.tiers import ipc_socket_path

        host, port = server.endpoint
        requests_socket = ipc_socket_path(host, port)
        assert requests_socket and os.path.dirname(requests_socket) == server.channel_dir
        assert os.path.exists(requests_socket) and os.path.exists(server.metrics_socket)
        folder = os.stat(server.channel_dir)
        assert folder.st_uid == os.geteuid() and folder.st_mode & 0o777 == 0o700
        if os.geteuid() == 0:  # only root can act as another user here
            nobody = pwd.getpwnam("nobody")
            for path in (requests_socket, server.metrics_socket):
                assert _connect_as(nobody.pw_uid, nobody.pw_gid, path) == errno.EACCES

        engine = EngineProcess(tiny_model_dir, host, port, tmp_path / "engine.log", num_blocks=64)
        engine.wait_ready(timeout=400)
        prompt = [random.Random(11).randrange(10, 1000) for _ in range(8 * BLOCK)]
        assert engine.generate(prompt).get("num_cached_tokens") == 0
        _reset(engine)  # the engine's own cache is empty: what comes back was loaded from the server
        again = engine.generate(prompt)
        assert again.get("num_cached_tokens", 0) >= 7 * BLOCK, again
        assert server.tier_metrics()["host_hit_tokens"] >= again["num_cached_tokens"]
    finally:
        if engine is not None:
            stop_engines([engine])  # the engine before its server: a connector waits for a gone server
        server.stop()
    assert not os.path.exists(server.channel_dir)

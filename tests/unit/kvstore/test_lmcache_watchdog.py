"""Unit tests: the node server's watchdog (`LMCacheServer.supervise`) against a hung LMCache server and against
its owner's stop, with `sleep` (or a slow-to-exit Python) in place of LMCache's server.

A hung server (deadlocked, SIGSTOPped) keeps its process and its sockets, which take connections into their
backlog and answer nothing: the watchdog must restart it once it has stayed silent, and not a server that
answers. A stop by the owner while the watchdog is restarting the server must stay a stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from kvmesh.kvstore import lmcache_server, node_server
from kvmesh.kvstore.lmcache_main import start_unix_metrics_server
from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.tiers import TierConfig

# a server that takes 1 s to end on SIGTERM, as LMCache's does while it shuts its workers down
SLOW_EXIT = "import signal, sys, time\nsignal.signal(15, lambda *a: (time.sleep(1), sys.exit(0)))\ntime.sleep(60)"


@pytest.fixture
def launches(monkeypatch):
    """lmcache_server's launches run `sleep` (or the script `launches.script`, when set) in place of LMCache's
    server; yields the processes, which it ends afterwards."""
    real_popen = subprocess.Popen
    procs: list[subprocess.Popen] = []
    spec = types.SimpleNamespace(procs=procs, script=None)

    def popen(cmd, **kwargs):
        command = [sys.executable, "-c", spec.script] if spec.script else ["sleep", "60"]
        procs.append(real_popen(command, start_new_session=True))
        return procs[-1]

    monkeypatch.setattr(lmcache_server, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": popen}))
    monkeypatch.setattr(lmcache_server, "RESTART_DARK_S", 0.0)
    monkeypatch.setattr(lmcache_server, "port_open", lambda host, port, timeout=0.5: True)
    yield spec
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


class _Metrics:
    """The server's metrics socket, served as lmcache_main serves it, until `hang()`: then it still takes
    connections (into its backlog) and answers none, as a hung server's does."""

    def __init__(self, path: str):
        from prometheus_client import CollectorRegistry, Counter

        registry = CollectorRegistry()
        Counter("lmcache_mp_lookup_requested_tokens", "stand-in", registry=registry)
        self.server, self.thread = start_unix_metrics_server(path, registry)

    def hang(self) -> None:
        self.server.shutdown()  # its socket stays open: connections queue, unanswered

    def close(self) -> None:
        self.server.server_close()


def test_a_hung_server_is_restarted_once_it_stayed_silent_and_one_that_answers_is_not(launches, monkeypatch):
    """A SIGSTOPped server's sockets still took connections: health said serving (a connect() landing in the
    backlog), and the watchdog, which only asked whether the process existed, never restarted it."""
    monkeypatch.setattr(lmcache_server, "SCRAPE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(lmcache_server, "UNANSWERED_RESTART_S", 1.0)
    srv = LMCacheServer(TierConfig.from_dict({"start_timeout_s": 5}))
    metrics = None
    try:
        srv.launch()
        metrics = _Metrics(srv.metrics_socket)
        assert srv.wait_ready() == srv.endpoint and srv.health()["serving"]
        for _ in range(4):  # a server that answers is left alone, however many looks
            assert srv.supervise() == "ok"
        hung = srv.proc
        assert hung is not None
        os.kill(hung.pid, signal.SIGSTOP)
        metrics.hang()
        health = srv.health()
        # a scrape unanswered is not yet a hung server (a busy node's may answer late): serving, not healthy
        assert health["alive"] and health["serving"] and not health["healthy"]
        assert srv.supervise() == "ok" and srv.supervise() == "ok"  # silent, but not for long yet
        assert srv.unanswered == 2 and srv.restarts == 0
        time.sleep(1.0)
        assert not srv.health()["serving"]  # silent as long as the watchdog waits: not serving
        srv.wait_ready = lambda: srv.endpoint  # type: ignore[method-assign]  # its successor: `sleep`
        started = time.monotonic()
        assert srv.supervise() == "restarted-unanswering" and srv.restarts == 1
        assert hung.poll() is not None and time.monotonic() - started < 5  # a stopped process ends on SIGTERM too
        assert srv.alive() and srv.proc is not hung and len(launches.procs) == 2
        # the new process has not answered since its launch: its start timeout comes first
        assert srv.supervise() == "ok" and srv.restarts == 1
    finally:
        srv.stop()
        if metrics is not None:
            metrics.close()


def test_a_server_that_never_answered_since_its_launch_gets_its_start_timeout_first(launches, monkeypatch):
    monkeypatch.setattr(lmcache_server, "SCRAPE_TIMEOUT_S", 0.1)
    monkeypatch.setattr(lmcache_server, "UNANSWERED_RESTART_S", 0.3)
    srv = LMCacheServer(TierConfig.from_dict({"start_timeout_s": 1.0}))
    try:
        srv.launch()  # nothing serves its metrics: no answer since its launch
        for _ in range(3):
            assert srv.supervise() == "ok"
        srv.wait_ready = lambda: srv.endpoint  # type: ignore[method-assign]
        time.sleep(1.5 - (time.monotonic() - srv.launched_at))
        assert srv.supervise() == "restarted-unanswering" and srv.restarts == 1
    finally:
        srv.stop()


def test_a_watchdog_relaunch_does_not_make_a_server_its_owner_stopped_wanted_again(launches):
    srv = LMCacheServer(TierConfig.from_dict({}))
    srv.wait_ready = lambda: srv.endpoint  # type: ignore[method-assign]
    srv._scrape = lambda timeout=5.0: "x 0\n"  # type: ignore[method-assign]
    srv.start()
    stops = srv.stops
    srv.stop()
    srv.start_again(wait=True, stops=stops)  # a relaunch the watchdog began before the stop
    assert not srv.wanted and not srv.alive() and len(launches.procs) == 1
    assert not os.path.exists(srv.channel_dir)


def test_a_stop_while_the_watchdog_restarts_the_server_is_honoured(launches, monkeypatch):
    """The watchdog's relaunch set `wanted` again and took its stop count only once it began launching: a stop
    landing while it waited for the old process to end was lost, and a new server ran after stop() returned,
    its private folder made again."""
    launches.script = SLOW_EXIT
    monkeypatch.setattr(lmcache_server, "shared_tier_reachable", lambda l2, timeout=1.0: True)
    monkeypatch.setattr(lmcache_server, "shared_tier_probe", lambda l2, timeout=1.0: True)
    monkeypatch.setattr(lmcache_server, "shared_tier_run_id", lambda l2, timeout=1.0: "run-1")
    monkeypatch.setattr(LMCacheServer, "wait_ready", lambda self: self.endpoint)
    monkeypatch.setattr(LMCacheServer, "_scrape", lambda self, timeout=5.0: "x 0\n")
    core = node_server.NodeServerCore({"l2": "redis://127.0.0.1:1", "watch_interval_s": 0.05})
    srv = core.server
    time.sleep(0.5)  # the first process has set its SIGTERM handler
    in_halt = threading.Event()
    real_halt = srv._halt

    def halt(*args, **kwargs):
        if threading.current_thread().name == "kvmesh-lmcache-watchdog":
            in_halt.set()
        return real_halt(*args, **kwargs)

    srv._halt = halt  # type: ignore[method-assign]
    srv.shared_seen_down = True  # seen down, now up: the next look restarts the server with its tier
    assert in_halt.wait(5)
    time.sleep(0.2)  # the watchdog waits for the old process to end
    core.stop()
    deadline = time.monotonic() + 5
    while core.last_supervise == "ok" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert [p.pid for p in launches.procs if p.poll() is None] == []
    assert not srv.alive() and not srv.wanted and not os.path.exists(srv.channel_dir)
    assert core.last_supervise == "stopped" and len(launches.procs) == 1

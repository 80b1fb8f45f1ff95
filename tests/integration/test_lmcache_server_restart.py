"""Unit tests: a restarted LMCache server stays dark long enough for every engine connector to notice.

Why: LMCache's connector re-registers its KV caches with a restarted server only after one of its
heartbeat PINGs went unanswered, and the new server answers PING for workers it does not know. A
restart faster than two heartbeats left engines sending stores to a server that never heard of them,
each waiting out the message-queue timeout (CI: `engine worker silent for 120 s`). The real-server
version of this is tests/integration/test_tiers_lmcache.py::test_shared_tier_loss_then_return; here a stand-in
process (our own `LMCacheServer.command` hook) measures the dark period itself in a second.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from kvmesh.kvstore.lmcache_server import RESTART_DARK_S, LMCacheServer, port_open
from kvmesh.kvstore.tiers import HEARTBEAT_S, MQ_TIMEOUT_S, TierConfig, ipc_socket_path, kv_transfer_config

# Listens on the request socket and answers HTTP on the metrics socket, like the server's two endpoints (unix
# sockets in the server's private folder; a socket file left by a killed stand-in is replaced).
_STAND_IN = r"""
import http.server, os, socket, socketserver, sys, threading
requests, metrics = sys.argv[1], sys.argv[2]
for path in (requests, metrics):
    if os.path.exists(path):
        os.unlink(path)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind(requests); s.listen()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"# stand-in\n")
    def address_string(self):
        return "local"
    def log_message(self, *a):
        pass
class Metrics(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
threading.Thread(target=Metrics(metrics, H).serve_forever, daemon=True).start()
while True:
    s.accept()[0].close()
"""


class StandInServer(LMCacheServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _STAND_IN, ipc_socket_path(*self.endpoint), self.metrics_socket]


class DarkMeter:
    """Polls the request socket as a connector would; records the longest time it was closed."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.longest = 0.0
        self.closed_since: float | None = None
        self.reopened = threading.Event()  # it saw the socket closed, then open again
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            now = time.monotonic()
            if port_open(self.host, self.port, timeout=0.2):
                if self.closed_since is not None:
                    self.longest = max(self.longest, now - self.closed_since)
                    self.closed_since = None
                    self.reopened.set()
            elif self.closed_since is None:
                self.closed_since = now
            time.sleep(0.05)

    def stop(self, reopen_s: float = 10.0) -> float:
        """The longest dark period seen, once the meter saw the socket open again (at most `reopen_s` later): a
        server back up when `restart` returns may not have been polled yet by a meter kept off the cores, which
        stopped at once measured no dark period at all."""
        self.reopened.wait(reopen_s)
        self.done.set()
        self.thread.join(5)
        return self.longest


def _server(tmp_path) -> StandInServer:
    cfg = TierConfig(start_timeout_s=30)
    return StandInServer(cfg, tmp_path / "stand-in.log")


def test_restart_keeps_the_port_dark_for_more_than_two_heartbeats(tmp_path):
    srv = _server(tmp_path)
    srv.start()
    try:
        first = srv.endpoint
        meter = DarkMeter(*first)
        time.sleep(0.2)
        assert srv.restart() == first  # same endpoint: engines keep their configured one
        dark = meter.stop()
        assert dark >= RESTART_DARK_S - 0.1
        assert RESTART_DARK_S > 2 * HEARTBEAT_S  # a PING sent during the outage must time out
        assert srv.restarts == 1 and srv.health()["serving"] is True
    finally:
        srv.stop()


def test_watchdog_restart_of_a_dead_server_is_dark_too(tmp_path):
    srv = _server(tmp_path)
    srv.start()
    try:
        meter = DarkMeter(*srv.endpoint)
        time.sleep(0.2)
        os.killpg(srv.proc.pid, signal.SIGKILL)  # died just now: the connectors have not seen it yet
        srv.proc.wait(10)
        assert srv.supervise() == "restarted-dead"
        assert meter.stop() >= RESTART_DARK_S - 0.1
        assert srv.alive() and port_open(*srv.endpoint)
    finally:
        srv.stop()


def test_first_start_is_not_delayed(tmp_path):
    srv = _server(tmp_path)
    t0 = time.monotonic()
    srv.launch()
    try:
        assert srv.proc is not None and time.monotonic() - t0 < 1.0
        srv.wait_ready()
    finally:
        srv.stop()


def test_connector_liveness_settings_reach_lmcache():
    """The keys must be the ones LMCache's connector reads, or it silently keeps 10 s / 300 s."""
    from lmcache.integration.vllm.vllm_multi_process_adapter import _resolve_extra_config

    extra = kv_transfer_config("127.0.0.1", 5599)["kv_connector_extra_config"]
    resolved = _resolve_extra_config(extra)
    assert resolved["heartbeat_interval"] == HEARTBEAT_S < 10.0
    assert resolved["mq_timeout"] == MQ_TIMEOUT_S < 300.0
    # the server reaps a worker silent for 30 s; three missed heartbeats must stay under that
    assert 3 * HEARTBEAT_S <= 30.0


def test_stop_during_the_dark_period_starts_nothing(tmp_path):
    """The node server's watchdog may be waiting out the dark period when the node shuts down."""
    srv = _server(tmp_path)
    srv.start()
    host, port = srv.endpoint
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    watchdog = threading.Thread(target=srv.supervise, kwargs={"wait": False}, daemon=True)
    watchdog.start()
    time.sleep(0.5)  # the watchdog is now inside the dark period
    srv.stop()
    watchdog.join(RESTART_DARK_S + 5)
    assert not watchdog.is_alive()
    assert srv.proc is None and not port_open(host, port)

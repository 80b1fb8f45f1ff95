"""Run one LMCache multi-process server as a child process: `python -m kvmesh.kvstore.lmcache_main`, which
runs LMCache's own server (`lmcache.v1.multiprocess.server`) on unix sockets only.

Why a process and not a library call: the MP server is the only LMCache mode that works with vLLM on
CPU, and it is meant to outlive engines (several engines on a node share its host-memory tier). The
manager makes the server's private folder, waits until both its ZMQ request socket and its metrics socket
answer, reports health (process, sockets, shared tier reachable), scrapes metrics, and stops the whole
process group. Stop engines before their server: a vLLM connector whose server vanished waits out its
message-queue timeout (`kvmesh.kvstore.tiers.MQ_TIMEOUT_S`) on shutdown.

Why no TCP port: LMCache's request server has no authentication, and its engine-driven transfer path
unpickles what a client sends; any local user who could connect could run code as kvmesh's user and read
or clear every tenant's KV. Both sockets are unix sockets in a 0700 folder of the server's owner
(`new_channel_dir`), which only processes of that user (the node's engines) can open.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

from kvmesh.deployments.process_tree import die_with_parent
from kvmesh.kvstore.lmcache_metrics import parse_prometheus, tier_summary
from kvmesh.kvstore.private_dir import PrivateDirError, owned_temp_dir, private_dir, remove_dead_owners_dirs
from kvmesh.kvstore.tiers import (
    CREDENTIAL_ENV,
    HEARTBEAT_S,
    PASSWORD_PLACEHOLDER_PREFIX,
    SOCKET_PORT,
    TierConfig,
    TierConfigError,
    ipc_socket_path,
    l2_credentials_env,
    metrics_socket_path,
    request_host,
    server_args,
)

_QUIET_ENV = {
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONWARNINGS": "ignore::FutureWarning",
}

# How long a restart keeps the server's port dark. An engine's connector re-registers its KV caches
# only after a heartbeat PING went unanswered (the new server answers PING for any worker, known or
# not). Its PINGs are `HEARTBEAT_S` apart and each waits `HEARTBEAT_S`, so an outage shorter than two
# heartbeats can pass unseen; the engine then sends stores and retrieves for a KV registration the new
# server never had, and each waits out the whole message-queue timeout. Three heartbeats plus slack
# make every restart visible to every connector.
RESTART_DARK_S = 3 * HEARTBEAT_S + 2.0
# How long the second probe of a shared tier that failed one gives it to answer (`shared_tier_up`).
SLOW_PROBE_S = 3.0
# When the watchdog takes a live server for hung (`unanswering`): none of its last UNANSWERED_SCRAPES metrics
# scrapes, each given SCRAPE_TIMEOUT_S, answered, and none for UNANSWERED_RESTART_S. A server busy copying KV
# for its engines still answers a scrape within seconds (its metrics are served by a thread of their own), so
# these are wide: a restart empties the node's host tier.
SCRAPE_TIMEOUT_S = 5.0
UNANSWERED_SCRAPES = 3
UNANSWERED_RESTART_S = 30.0


# Where servers' private folders go: /tmp keeps their socket paths within ipc's ~107 bytes.
CHANNEL_ROOT = "/tmp"
CHANNEL_PREFIX = "kvmesh-lmcache-"


def remove_dead_channel_dirs(root: str | None = None) -> int:
    """Remove servers' private folders (kvmesh-lmcache-<owner pid>-*) whose owner is gone."""
    return remove_dead_owners_dirs(CHANNEL_PREFIX, root or CHANNEL_ROOT)


def new_channel_dir() -> str:
    """A fresh 0700 folder (mkdtemp) for one server's sockets, named after this (owning) process."""
    remove_dead_channel_dirs()
    return owned_temp_dir(CHANNEL_PREFIX, CHANNEL_ROOT)


class LMCacheServerError(RuntimeError):
    """The server did not start or died; the message says why and where its log is."""


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Does something accept connections at host:port? An ipc:// host is the unix socket LMCache's connector
    opens (`ipc_socket_path`), any other a TCP host."""
    path = ipc_socket_path(host, port)
    try:
        if path is None:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            return True
    except OSError:
        return False


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket: how kvmesh reads the server's metrics."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def unix_http_get(socket_path: str, url_path: str, timeout: float = 5.0) -> str | None:
    """The body of a 200 answer to GET url_path over a unix socket; None when nothing answers so."""
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        conn.request("GET", url_path)
        reply = conn.getresponse()
        body = reply.read().decode()
        return body if reply.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _resp_command(*parts: str) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        data = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _RespError(Exception):
    """A RESP error reply (-ERR, -NOAUTH, -WRONGPASS, -NOPERM ...)."""


def _resp_reply(f) -> bytes | int | None:
    """One RESP2 reply (simple string, error, integer or bulk string) from a socket's file."""
    line = f.readline(65536)
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise _RespError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        data = f.read(size + 2)
        if len(data) != size + 2:
            raise ConnectionError("connection closed mid-reply")
        return data[:-2]
    raise ConnectionError(f"not a RESP reply: {kind!r}")


def _resp_ask(
    host: str, port: int, timeout: float, password: str | None, username: str | None, command: tuple[str, ...]
) -> bytes | int | None:
    """Connect, AUTH as LMCache's client does (when there is a password), send one command and return its
    reply; _RespError for an error reply (a refused AUTH included), OSError when nothing answers."""
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        f = s.makefile("rb")
        if password:
            s.sendall(_resp_command("AUTH", *([username] if username else []), password))
            if _resp_reply(f) != b"OK":
                raise _RespError("AUTH not accepted")
        s.sendall(_resp_command(*command))
        return _resp_reply(f)


def redis_probe(
    host: str, port: int, timeout: float = 1.0, password: str | None = None, username: str | None = None
) -> bool | None:
    """`redis_ping`, telling a server that did not answer in time (None: stalled, a connect or PING that timed
    out) from one that cannot be used (False: refused, closed, AUTH rejected)."""
    try:
        return _resp_ask(host, port, timeout, password, username, ("PING",)) == b"PONG"
    except TimeoutError:
        return None
    except (OSError, ValueError, _RespError):
        return False


def redis_ping(
    host: str, port: int, timeout: float = 1.0, password: str | None = None, username: str | None = None
) -> bool:
    """True when a RESP server answers PING (after AUTH when it needs a password): how kvmesh tells
    the shared tier is up."""
    return bool(redis_probe(host, port, timeout, password, username))


def redis_run_id(
    host: str, port: int, timeout: float = 1.0, password: str | None = None, username: str | None = None
) -> str | None:
    """The `run_id` of INFO server: random per Redis/Valkey process, so a changed one is a restart, however
    short (None when it cannot be read: down, AUTH refused, INFO not allowed to this user)."""
    try:
        info = _resp_ask(host, port, timeout, password, username, ("INFO", "server"))
    except (OSError, ValueError, _RespError):
        return None
    if not isinstance(info, bytes):
        return None
    for line in info.decode(errors="replace").splitlines():
        if line.startswith("run_id:"):
            return line.partition(":")[2].strip() or None
    return None


def _resp_address(l2: dict | None) -> tuple[str, int] | None:
    """(host, port) of a `resp` shared tier, the one LMCache 0.5.6's native client (which never reconnects) is
    used for; None for any other. Valkey is not: LMCache's valkey adapter finds a cluster from any of its
    startup nodes (`_valkey_seeds`), so its first node down or restarted says nothing of the tier."""
    if not l2 or l2.get("type") != "resp":
        return None
    return l2["host"], int(l2["port"])


def _valkey_seeds(l2: dict | None) -> list[tuple[str, int]]:
    """(host, port) of each of a valkey tier's startup nodes ([] for any other tier)."""
    if not l2 or l2.get("type") != "valkey":
        return []
    seeds = []
    for node in str(l2.get("startup_nodes", "")).split(","):
        host, _, port = node.strip().rpartition(":")
        if host and port.isdigit():
            seeds.append((host, int(port)))
    return seeds


def l2_credentials(l2: dict | None, env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(username, password) the way LMCache's adapter for `l2` authenticates: resp takes each from its JSON,
    else from LMCACHE_RESP_USERNAME / LMCACHE_RESP_PASSWORD in the server's environment (`env`, default this
    process's); valkey only from its JSON. A probe that authenticated otherwise would judge an ACL user's
    tier down for good, or a tier LMCache cannot use up."""
    if not l2:
        return None, None
    username, password = l2.get("username") or None, l2.get("password") or None
    if l2.get("type") == "resp":
        env = os.environ if env is None else env
        username = username or env.get(CREDENTIAL_ENV["username"]) or None
        password = password or env.get(CREDENTIAL_ENV["password"]) or None
    return (str(username) if username else None), (str(password) if password else None)


def shared_tier_probe(l2: dict | None, timeout: float = 1.0) -> bool | None:
    """`shared_tier_reachable`, with None also for a RESP tier that did not answer within `timeout` (stalled or
    unreachable: `redis_probe`) rather than refused it."""
    if not l2:
        return None
    kind = l2.get("type")
    if kind in ("resp", "valkey"):
        address = _resp_address(l2)
        seeds = [address] if address else _valkey_seeds(l2)
        if not seeds:
            return None
        username, password = l2_credentials(l2)
        answers = []
        for seed in seeds:  # valkey: up when any seed answers (its adapter finds the cluster from any)
            answer = redis_probe(*seed, timeout, password=password, username=username)
            if answer:
                return True
            answers.append(answer)
        return None if None in answers else False
    if kind == "fs":
        path = Path(l2["base_path"])
        return path.is_dir() and os.access(path, os.W_OK)
    return None


def shared_tier_reachable(l2: dict | None, timeout: float = 1.0) -> bool | None:
    """Probe the configured L2 directly (None = no shared tier, or an adapter kvmesh cannot probe); a RESP
    server must accept the credentials LMCache uses (`l2_credentials`) and answer within `timeout` seconds;
    a valkey tier is up when any of its startup nodes does."""
    if l2 and l2.get("type") in ("resp", "valkey") and (_resp_address(l2) or _valkey_seeds(l2)):
        return shared_tier_probe(l2, timeout) is True
    return shared_tier_probe(l2, timeout)


def shared_tier_run_id(l2: dict | None, timeout: float = 1.0) -> str | None:
    """`redis_run_id` of a `resp` shared tier, authenticated as LMCache is (None for other adapters: valkey's
    adapter reconnects, so its nodes' restarts need no restart of the server)."""
    address = _resp_address(l2)
    if address is None:
        return None
    username, password = l2_credentials(l2)
    return redis_run_id(*address, timeout, password=password, username=username)


def refuse_placeholder_password(l2: dict | None, env: Mapping[str, str]) -> None:
    """TierConfigError when the shared tier's password is the published example's placeholder (REPLACE-...,
    k8s/secrets.example.yaml): that value is public, and the tier holds every tenant's KV chunks."""
    password = l2_credentials(l2, env)[1]  # the one LMCache uses: none without a tier, valkey's own
    if password and password.startswith(PASSWORD_PLACEHOLDER_PREFIX):
        raise TierConfigError(
            f"the shared tier's password ({CREDENTIAL_ENV['password']} or the l2 password) is the example's "
            f"placeholder ({PASSWORD_PLACEHOLDER_PREFIX}...): create it from random bytes, e.g. "
            "`openssl rand -hex 32` (docs/kubernetes.md)"
        )


class LMCacheServer:
    """One LMCache MP server process; `start()` blocks until it serves, `stop()` ends its process group."""

    def __init__(
        self,
        config: TierConfig,
        log_path: str | os.PathLike | None = None,
        env: dict | None = None,
        preexec_fn: Callable[[], None] | None = None,
        inherit_output: bool = False,
    ):
        config.validate()
        self.preexec_fn = preexec_fn  # None: the server dies with the thread that launches it (die_with_parent)
        self.config = config
        # the server's private folder, kept for the object's life so that a restart keeps the endpoint
        self.channel_dir = new_channel_dir()
        self._remove_channel_dir = weakref.finalize(self, shutil.rmtree, self.channel_dir, ignore_errors=True)
        self.port = SOCKET_PORT
        self.log_path = Path(log_path) if log_path else None
        # Without a log file: the server's output goes to this process's stderr (for a Ray actor, the
        # worker log Ray keeps with its session) when inherit_output, else nowhere.
        self.inherit_output = inherit_output
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.wanted = False  # started by its owner and not stopped by it: the watchdog keeps it running
        self.restarts = 0
        self.shared_seen_down = False  # the shared tier was unreachable since the last (re)start
        self.shared_losses = 0  # times the watchdog found the shared tier unreachable (it may be back empty)
        # running without its shared tier, which LMCache's client could not use (refused, AUTH rejected, hung):
        # see `supervise`
        self.without_shared = False
        # INFO run_id of the RESP shared tier the running process connected to: another one means that Redis
        # restarted, and LMCache's client stays broken even if no probe ever saw it down (`supervise`)
        self.shared_run_id: str | None = None
        # the watchdog's last verdict on the shared tier (`shared_tier_up`, at launch and each `supervise`):
        # what `health` goes by while its own quick probe gets no answer in time (a stall the watchdog rides out)
        self.shared_verdict: bool | None = None
        self.dark_until = 0.0  # monotonic time before which `launch` must not start a new process
        self.stops = 0  # counts `stop` calls: a watchdog's relaunch begun before a stop gives up (`launch`)
        # monotonic times of the last launch and of the last metrics scrape that answered, and how many of the
        # watchdog's scrapes in a row did not: how it tells a hung server (`unanswering`)
        self.launched_at = time.monotonic()
        self.answered_at = float("-inf")
        self.unanswered = 0

    @property
    def endpoint(self) -> tuple[str, int]:
        """What engines give their connector (`tiers.kv_transfer_config`): the ipc:// host and its port."""
        return request_host(self.channel_dir), self.port

    @property
    def metrics_socket(self) -> str:
        return metrics_socket_path(self.endpoint[0])

    def launch_config(self) -> TierConfig:
        """The configuration the process runs with: the owner's, less the shared tier while it cannot be used."""
        return dataclasses.replace(self.config, l2=None) if self.without_shared else self.config

    def server_env(self) -> dict[str, str]:
        """The environment a process with the configured tier gets: this process's, the tier's credentials, the
        owner's `env` (what LMCache reads credentials from)."""
        return {**os.environ, **_QUIET_ENV, **l2_credentials_env(self.config.l2), **(self.env or {})}

    def probe_l2(self) -> dict | None:
        """The configured L2 with the credentials the server's LMCache authenticates with (`l2_credentials` over
        `server_env`): what kvmesh's probes of the shared tier use, so that they judge it as LMCache would."""
        l2 = self.config.l2
        if not l2 or l2.get("type") != "resp":
            return l2
        username, password = l2_credentials(l2, self.server_env())
        extra = {k: v for k, v in (("username", username), ("password", password)) if v}
        return {**l2, **extra}

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvmesh.kvstore.lmcache_main",  # LMCache's server on ipc sockets only, metrics beside them
            *server_args(self.launch_config(), *self.endpoint),
        ]

    def start(self) -> tuple[str, int]:
        """Launch and wait until it serves (both ports answer)."""
        self.launch()
        return self.wait_ready()

    def launch(self, stops: int | None = None) -> None:
        """Start the process without waiting (start several servers, then `wait_ready` each).

        The owner's launch (no `stops`) makes the server wanted. The watchdog's relaunch passes the owner's stop
        count (`stops`) it read when its step began, and starts nothing once the owner has stopped the server
        since: a stop while the watchdog was ending the old process must stay a stop. Raises TierConfigError,
        starting nothing, when the shared tier's password is the published placeholder."""
        refuse_placeholder_password(self.config.l2, self.server_env())
        if stops is None:
            self.wanted = True
            stops = self.stops
        if self.alive():
            return
        while time.monotonic() < self.dark_until:  # a restart: every connector's heartbeat must see it
            time.sleep(min(0.25, max(0.0, self.dark_until - time.monotonic())))
            if self.stops != stops:  # stopped meanwhile (node shutting down): start nothing
                return
        if self.stops != stops or not self.wanted:
            return
        self.prepare_folders()
        self.choose_shared_tier()
        env = {**os.environ, **_QUIET_ENV, **l2_credentials_env(self.launch_config().l2), **(self.env or {})}
        log = open(self.log_path, "ab") if self.log_path else None
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log or (None if self.inherit_output else subprocess.DEVNULL),
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=self.preexec_fn or die_with_parent(),
            )
        finally:
            if log is not None:
                log.close()
        self.launched_at = time.monotonic()
        self.unanswered = 0
        if self.stops != stops:  # stopped while this started: the stop may have found no process to end
            self._halt()
            shutil.rmtree(self.channel_dir, ignore_errors=True)

    def choose_shared_tier(self) -> None:
        """Before a launch with a `resp` shared tier (not valkey, whose adapter reconnects): probe it with
        LMCache's credentials, and launch without it when it does not answer. Why: LMCache 0.5.6's native Redis
        client, started while its tier refuses connections or rejects AUTH, has no live worker and never
        completes an operation, so every request whose prompt fills a chunk hung for good (seen: 90 s and more
        each). The watchdog launches it with the tier again once a probe succeeds (`supervise`). Records the
        tier's run_id the server connects to."""
        if self.without_shared or _resp_address(self.config.l2) is None:
            return
        if self.shared_tier_up() is False:
            if not self.shared_seen_down:
                self.shared_losses += 1
            self.shared_seen_down = True
            self.without_shared = True
            self.shared_run_id = None
        else:
            self.shared_run_id = shared_tier_run_id(self.probe_l2())

    def prepare_folders(self) -> None:
        """The server's private folder (made again after a stop) and an fs shared tier's folder: 0700 and ours,
        or the launch fails (LMCacheServerError) rather than serve through a folder others can enter."""
        try:
            private_dir(self.channel_dir)
            if self.config.l2 and self.config.l2.get("type") == "fs":
                private_dir(self.config.l2["base_path"])
        except (PrivateDirError, OSError) as exc:
            raise LMCacheServerError(f"LMCache server not started: {exc}") from None

    def wait_ready(self) -> tuple[str, int]:
        proc = self.proc
        if proc is None:
            raise LMCacheServerError("LMCache server was not launched")
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not proc:  # its owner stopped it meanwhile (from another thread)
                raise LMCacheServerError("LMCache server was stopped during start-up")
            if proc.poll() is not None:
                raise LMCacheServerError(
                    f"LMCache server exited with code {proc.returncode} during start-up ({self.output_where()})"
                )
            if port_open(*self.endpoint) and self._scrape(timeout=2.0) is not None:
                return self.endpoint
            time.sleep(0.25)
        self._halt()  # still wanted: the watchdog tries again
        raise LMCacheServerError(
            f"LMCache server not ready after {self.config.start_timeout_s:.0f} s ({self.output_where()})"
        )

    def output_where(self) -> str:
        """Where the server's output went, for an error message."""
        if self.log_path:
            return f"log: {self.log_path}"
        return "output: the owning process's stderr" if self.inherit_output else "output discarded"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """The owner's stop: the process ends and stays ended, and its private folder goes with it."""
        self.stops += 1
        self.wanted = False
        self._halt(timeout)
        shutil.rmtree(self.channel_dir, ignore_errors=True)

    def _halt(self, timeout: float = 20.0) -> None:
        """End the process (its whole group); the port stays dark for RESTART_DARK_S."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) server handles its SIGTERM only so
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self.proc = None
        self.dark_until = time.monotonic() + RESTART_DARK_S

    def restart(self) -> tuple[str, int]:
        """Same ports again, so engines configured with this endpoint reconnect to the new process.

        The port stays dark for RESTART_DARK_S first, so connectors notice and re-register."""
        self._halt()
        self.restarts += 1
        self.shared_seen_down = False
        return self.start()

    def supervise(self, wait: bool = True) -> str:
        """One watchdog step: restart a dead or hung server, one whose RESP shared tier is unusable, or one whose
        RESP shared tier is back.

        A hung server (deadlocked, SIGSTOPped) keeps its process and its sockets, which take connections into
        their backlog without an answer: it is restarted once its metrics have not answered for a while
        (`unanswering`). LMCache 0.5.6's Redis (`resp`) client never reconnects: after Redis restarts, every L2
        store and lookup keeps failing (requests still succeed, by recomputing). Restarting the server on the
        same ports is the recovery; engines' connectors reconnect to it and re-register their KV caches (the
        port is kept dark for RESTART_DARK_S so that their heartbeats see the restart); the node's L1 contents
        are lost. A restart of Redis between two looks is seen from its INFO run_id (`redis_run_id`): it counts
        as down and back. A RESP shared tier that does not answer as LMCache needs is worse than a lost one:
        LMCache's client has no timeout for one that hangs (takes connections, never answers), and a client
        (re)started while the tier refuses connections or rejects AUTH never completes an operation; either way
        every request whose prompt fills a chunk never returns. The server is then restarted without its shared
        tier, which lets the engines' requests that waited on it fail over to recomputing (their connectors'
        timeout), and with it again once a probe, AUTH included, succeeds. Other shared tiers (valkey, whose
        adapter reconnects; fs, which opens a file per operation) restart nothing: their outage is counted
        (`shared_losses`: it may be back empty) and forgotten once they answer. A stop by the owner during a
        step is honoured: the step relaunches nothing. Returns what it did: "ok", "shared-down",
        "restarted-dead", "restarted-unanswering", "restarted-without-shared", "restarted-shared-back",
        "stopped". With wait=False a restart only launches the process after the dark period (call
        `wait_ready` later).
        """
        stops = self.stops  # a stop from here on is one this step's relaunch must not undo
        if self.wanted and not self.alive():  # died, or a restart that failed to launch or to serve
            return self._relaunch("restarted-dead", wait, stops)
        if self.wanted and self.unanswering():
            self._halt()
            return self._relaunch("restarted-unanswering", wait, stops)
        up = self.shared_tier_up()
        resp = _resp_address(self.config.l2) is not None
        if up is False:
            if not self.shared_seen_down:
                self.shared_losses += 1
            self.shared_seen_down = True
            if self.wanted and not self.without_shared and resp:
                self.without_shared = True
                self._halt()
                step = self._relaunch("restarted-without-shared", wait, stops)
                self.shared_seen_down = True  # restarted with it again once it answers
                return step
            return "shared-down"
        if up and not resp:  # its adapter carries on by itself: the loss stays counted, the server runs on
            self.shared_seen_down = False
            return "ok"
        if up and not self.without_shared and self.shared_tier_restarted():
            if not self.shared_seen_down:
                self.shared_losses += 1  # down and back between two looks: it may be back empty
            self.shared_seen_down = True
        if up and self.wanted and (self.shared_seen_down or self.without_shared):
            self.without_shared = False
            self._halt()
            return self._relaunch("restarted-shared-back", wait, stops)
        return "ok"

    def _relaunch(self, step: str, wait: bool, stops: int) -> str:
        """`start_again` for the watchdog's `step`; "stopped" when the owner stopped the server since `stops`."""
        self.start_again(wait, stops)
        return step if self.stops == stops else "stopped"

    def unanswering(self) -> bool:
        """One look of the watchdog at a live server's metrics: is it hung? True once none of its last
        UNANSWERED_SCRAPES scrapes answered and it has been silent UNANSWERED_RESTART_S, counted from its last
        answer to any scrape, or from the end of its start timeout when none answered since its launch."""
        if self._scrape(timeout=SCRAPE_TIMEOUT_S) is not None:
            self.unanswered = 0
            return False
        self.unanswered += 1
        return self.unanswered >= UNANSWERED_SCRAPES and self.silent()

    def silent(self) -> bool:
        """Has the server answered no metrics scrape for UNANSWERED_RESTART_S, counted from its last answer, or
        from the end of its start timeout when none answered since its launch? One slow scrape on a busy node is
        not silence."""
        if self.answered_at >= self.launched_at:
            silent_from = self.answered_at
        else:
            silent_from = self.launched_at + self.config.start_timeout_s
        return time.monotonic() - silent_from >= UNANSWERED_RESTART_S

    def shared_tier_restarted(self) -> bool:
        """Has the RESP shared tier's process changed (INFO run_id) since this server connected to it? A run_id
        that could not be read says nothing; the first one read becomes the one compared against."""
        run_id = shared_tier_run_id(self.probe_l2())
        if run_id is None:
            return False
        if self.shared_run_id is None:
            self.shared_run_id = run_id
            return False
        return run_id != self.shared_run_id

    def shared_tier_up(self) -> bool | None:
        """Is the shared tier reachable, as the watchdog judges it before a restart (`supervise`)? A probe
        that fails is repeated once with `SLOW_PROBE_S` to answer before it counts. Why: a shared tier seen
        down and then up restarts this server, and a Redis PING slower than a second on a machine busy
        starting engines is not an outage: seen live, that restart lost the node's host tier, and an engine
        that had registered before it, its connector's heartbeat not yet running, never registered again and
        failed its requests. A refused connection fails both probes at once, so a real outage counts as
        before. `health()` keeps one quick probe: the node actor answers its callers one at a time, and a
        second, slower probe there would hold up every router's health call during an outage."""
        l2 = self.probe_l2()
        up = shared_tier_reachable(l2)
        self.shared_verdict = shared_tier_reachable(l2, timeout=SLOW_PROBE_S) if up is False else up
        return self.shared_verdict

    def start_again(self, wait: bool = True, stops: int | None = None) -> None:
        """The watchdog's relaunch; with `stops` (the owner's stop count when its step began) none after a stop."""
        # a server found dead may have died just now: keep the port dark from here, too
        self.dark_until = max(self.dark_until, time.monotonic() + RESTART_DARK_S)
        self.proc = None
        self.restarts += 1
        self.shared_seen_down = False
        stops = self.stops if stops is None else stops
        self.launch(stops)
        if wait and self.stops == stops:
            self.wait_ready()

    def _scrape(self, timeout: float | None = None) -> str | None:
        text = unix_http_get(self.metrics_socket, "/metrics", SCRAPE_TIMEOUT_S if timeout is None else timeout)
        if text is not None:
            self.answered_at = time.monotonic()
        return text

    def metrics(self) -> dict:
        """Parsed Prometheus samples ({} when the server does not answer)."""
        text = self._scrape()
        return parse_prometheus(text) if text else {}

    def tier_metrics(self, chunk_bytes: int | None = None) -> dict:
        """The tier figures, or {} when the server does not answer: zeros would read as a counter reset."""
        samples = self.metrics()
        return tier_summary(samples, chunk_bytes) if samples else {}

    def health(self) -> dict:
        """What /health and /metrics report: is the host tier serving, is the shared tier reachable. Not
        healthy while the process runs with a shared tier it cannot use (down, AUTH refused, or a Redis that
        restarted since it connected: LMCache's client never reconnects) until the watchdog restarts it. Not
        serving once its metrics have been `silent` as long as the watchdog waits before it restarts a hung
        server (whose sockets still take connections, into their backlog); one scrape a busy node answers late
        leaves it serving, with the contents the routers model."""
        alive = self.alive()
        text = self._scrape() if alive else None
        samples = parse_prometheus(text) if text else {}
        serving = alive and (text is not None or not self.silent()) and port_open(*self.endpoint)
        # One quick probe. A tier that does not answer in time (stalled, as Redis is in a long fork or fsync) is
        # judged as the watchdog last judged it (`shared_verdict`), which gives it SLOW_PROBE_S more before it
        # counts as down: health must not call unhealthy what the watchdog rides out; its run_id is then not
        # read (it would stall as long again). A refused connection or AUTH, or a changed run_id, is what the
        # watchdog acts on at its next look, so it counts at once.
        fresh = shared_tier_probe(self.probe_l2())
        stalled = fresh is None and bool(_resp_address(self.config.l2) or _valkey_seeds(self.config.l2))
        shared_up = bool(self.shared_verdict) if stalled else fresh  # not judged yet: down, as before
        unusable = alive and self.launch_config().l2 is not None and shared_up is False
        if alive and fresh and not self.without_shared and self.shared_run_id is not None:
            run_id = shared_tier_run_id(self.probe_l2())
            unusable = run_id is not None and run_id != self.shared_run_id
        return {
            "alive": alive,
            "serving": serving,
            "metrics_ok": bool(samples),
            "endpoint": "{}:{}".format(*self.endpoint),
            "restarts": self.restarts,
            "shared_tier": self.config.shared_tier,
            "shared_tier_up": shared_up,
            "shared_tier_was_down": self.shared_seen_down,  # a restart is due once it is back
            "running_without_shared_tier": self.without_shared,  # LMCache could not use it: runs without
            "shared_tier_unusable": unusable,  # runs with it, and cannot use it: the watchdog restarts it
            "shared_tier_losses": self.shared_losses,
            "healthy": serving and bool(samples) and not unusable,
        }

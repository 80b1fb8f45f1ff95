"""Start Debian's `redis-server` on a free loopback port in a given dir (tests, calibration, demo).

A real Redis, not a fake: the shared-tier tests and the calibration must show LMCache's own `resp` adapter storing and
loading KV chunks, and what happens when that store disappears. No persistence (save "" and
appendonly no) so a restart comes back empty, like a lost cache node. It requires a password (random per
server, in `url`), as the shared tier does on KubeRay: it holds every tenant's KV chunks.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from kvmesh.cluster.ports import free_port
from kvmesh.deployments.process_tree import die_with_parent


def _ping(port: int, password: str | None) -> bool:
    from kvmesh.kvstore.lmcache_server import redis_ping

    return redis_ping("127.0.0.1", port, timeout=0.5, password=password)


class RedisNotInstalled(RuntimeError):
    """No `redis-server` on PATH."""


def redis_server_binary() -> str:
    """The `redis-server` program's path; RedisNotInstalled, saying how to install it, when there is none."""
    binary = shutil.which("redis-server")
    if not binary:
        raise RedisNotInstalled("redis-server is not installed: run `make services` (apt-get install redis-server)")
    return binary


class RedisServer:
    """One redis-server process; `stop()` then `start()` reuses the same port (tier loss and return)."""

    def __init__(self, workdir: str | os.PathLike, port: int | None = None, require_password: bool = True):
        self.binary = redis_server_binary()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = secrets.token_hex(16) if require_password else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> RedisServer:
        cmd = [
            self.binary,
            "-",  # the rest of the configuration (the password) comes on stdin, never in argv
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
        ]
        log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        log.close()
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"requirepass {self.password}\n".encode() if self.password else b"")
        self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.workdir / 'redis.log'}")
            if _ping(self.port, self.password):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and _ping(self.port, self.password)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

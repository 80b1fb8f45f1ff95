"""Child processes for the peer benchmark: each in its own process group (so a server and the workers
it spawns die together), stdout/stderr to a log file, and a readiness wait with a deadline. Why: the
machine is shared; every process we start must be stoppable by its own id, never by name. Each child also
gets SIGTERM from the kernel when the thread that started it ends (deployments/process_tree.py): a
benchmark killed outright leaves no vLLM server or peer router running in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.deployments.config import OFFLINE_ENV
from kvmesh.deployments.process_tree import die_with_parent

# vLLM OpenAI servers run their engine core in a child process (as shipped): no in-process override.
BENCH_ENV = {**OFFLINE_ENV, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@dataclass
class Proc:
    """One started child (and its process group)."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the group, then SIGKILL what is left after `timeout`."""
        if self.popen.poll() is not None:
            return
        pgid = self.popen.pid  # start_new_session=True: the child leads its own group
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def start(name: str, cmd: list[str], log_dir: Path, env: dict | None = None) -> Proc:
    """Start `cmd` in a new session with BENCH_ENV (+ `env`) and its output in `log_dir/name.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, **BENCH_ENV, **(env or {})}
    log = open(log_path, "wb")
    popen = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGTERM),
    )
    log.close()
    return Proc(name, popen, log_path)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(procs: list[Proc], urls: list[str], deadline_s: float) -> None:
    """Wait until every url answers 2xx; raise with the log tail if a process dies or time runs out."""
    end = time.monotonic() + deadline_s
    pending = dict(zip(urls, procs))
    while pending:
        for url, proc in list(pending.items()):
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited (rc={proc.popen.returncode}):\n{proc.log_tail()}")
            if http_ok(url):
                del pending[url]
        if not pending:
            return
        if time.monotonic() > end:
            names = ", ".join(p.name for p in pending.values())
            tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in pending.values())
            raise TimeoutError(f"not ready after {deadline_s:.0f}s: {names}\n{tails}")
        time.sleep(1.0)


def stop_all(procs: list[Proc]) -> None:
    for p in reversed(procs):
        p.stop()

"""`kvmesh serve` run as a service manager runs it, and the checks on how it stops: one subprocess in its own
process group with its own Ray (`Serve`), the sockets its processes listen on (`exposed_sockets`), and a stop
by one signal checked to leave nothing running, cut no request in flight and exit cleanly (`stop_and_check`).

Used by the live tests that start their own app; which test covers which way of stopping:
- tests/integration/test_serve_lifecycle.py: SIGTERM to the process group with streams in flight (they must
  finish), SIGKILL of the serve process alone;
- tests/integration/test_router_sync.py: SIGTERM to the serve process (an app with two ingress replicas);
- tests/integration/test_overload.py: SIGINT (Ctrl-C), after the flood.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from paths import REPO_ROOT

from kvmesh.deployments.process_tree import still_running

GONE_WITHIN_S = 10.0  # every process a stopped `kvmesh serve` started must end this soon after it exits
STOP_WAYS = ("sigint", "sigterm", "sigterm-group", "sigkill")


class Serve:
    """One `kvmesh serve --config <name>.yaml --port 0` subprocess in its own process group, as a service
    manager starts it, with a private Ray temp dir and its output in `<tmp>/<name>.out`."""

    def __init__(self, tmp: Path, name: str, config: str, args: tuple[str, ...] = ()):
        self.out_path = tmp / f"{name}.out"
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(config)
        self.ray_tmp = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")  # Ray's socket paths must stay short
        env = dict(os.environ, RAY_TMPDIR=self.ray_tmp, PYTHONUNBUFFERED="1", RAY_ADDRESS="127.0.0.1:1")
        self.out = open(self.out_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--config", str(cfg), "--port", "0", *args],
            cwd=REPO_ROOT,
            env=env,  # a RAY_ADDRESS pointing nowhere: kvmesh must start its own Ray, not join one
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url: str | None = None
        self.key: str | None = None  # the generated API key; None when the keys come from a tenants file
        self._seen: dict[int, psutil.Process] = {}

    def text(self) -> str:
        return self.out_path.read_text()

    def wait_serving(self, timeout_s: float = 600) -> None:
        """Wait for the banner's last line (`metrics: ... stop: Ctrl-C`), then read the URL and API key."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.text()
            if re.search(r"metrics: \S+ +stop: Ctrl-C", text):
                break
            time.sleep(0.2)
        m = re.search(r"kvmesh serving at (http://\S+)/v1", text)
        k = re.search(r"API key: (\S+)", text)
        self.url, self.key = (m.group(1) if m else None), (k.group(1) if k else None)
        assert self.url and (self.key or "API keys: from " in text), self.text()[-3000:]

    def tree(self) -> list[psutil.Process]:
        """The serve process and every process below it now (remembered for `cleanup`)."""
        root = psutil.Process(self.proc.pid)
        tree = [root, *root.children(recursive=True)]
        self._seen.update((p.pid, p) for p in tree)
        return tree

    def cleanup(self, sigint_wait_s: float = 0) -> None:
        """End whatever is left of the app: with `sigint_wait_s`, first SIGINT (kvmesh serve's clean stop) and up
        to that long for the serve process to exit; then SIGKILL to every process of its tree still running,
        including those seen by an earlier `tree()` (after a stop that failed its check, say)."""
        if self.proc.poll() is None:
            try:
                self.tree()
            except psutil.Error:
                pass
            if sigint_wait_s:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=sigint_wait_s)
                except subprocess.TimeoutExpired:
                    pass
        for p in self._seen.values():
            try:
                p.kill()  # psutil refuses a pid that now belongs to another process
            except psutil.Error:
                pass
        self.out.close()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def exposed_sockets(procs: list[psutil.Process]) -> list[str]:
    """Listening TCP / bound UDP sockets of `procs` on an address other than loopback."""
    bad = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN and c.type != 2:  # 2: SOCK_DGRAM
                continue
            ip = ipaddress.ip_address(c.laddr.ip)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            if not ip.is_loopback:
                bad.append(f"{name} (pid {p.pid}) on {c.laddr.ip}:{c.laddr.port}")
    return bad


def serves_on_loopback(serves: list[Serve]) -> None:
    """Each app answers a completion; every socket any of their processes listens on is on loopback."""
    for s in serves:
        r = httpx.post(
            s.url + "/v1/completions",
            headers={"Authorization": f"Bearer {s.key}"},
            json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    exposed = exposed_sockets([p for s in serves for p in s.tree()])
    assert not exposed, f"listening beyond loopback: {exposed}"


def taken_port_refused(serve: Serve) -> None:
    """A second `kvmesh serve` on `serve`'s port fails at once (exit 2), naming the port and its holder."""
    assert serve.url
    port = int(serve.url.rsplit(":", 1)[1])
    taken = subprocess.run(
        [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--port", str(port)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert taken.returncode == 2 and f"port {port}" in taken.stderr and "pid " in taken.stderr, taken.stderr


def survivors(procs: list[psutil.Process], within_s: float) -> list[str]:
    """Those of `procs` still running (zombies aside) after waiting up to `within_s` for them to end."""
    left = []
    for p in still_running(procs, within_s):
        try:
            left.append(f"{p.name()} (pid {p.pid})")
        except psutil.Error:
            pass
    return left


def stream(url: str, key: str | None, results: list, started: threading.Event) -> None:
    """One streaming completion long enough to be in flight when the stop signal comes."""
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    tokens, finish = 0, None
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                started.set()
                choice = json.loads(line[6:])["choices"][0]
                tokens += 1 if choice.get("text") is not None else 0
                finish = choice.get("finish_reason") or finish
            results.append((r.status_code, finish, tokens))
    except httpx.HTTPError as exc:
        results.append((None, repr(exc), tokens))
    finally:
        started.set()


def haproxy_folders(pids: set[int]) -> list[Path]:
    """The local runs' HAProxy folders (deployments/app.py) whose owner is one of `pids`."""
    out = []
    for folder in Path(tempfile.gettempdir()).glob("kvmesh-haproxy-*"):
        try:
            owner = int((folder / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if owner in pids:
            out.append(folder)
    return out


def stop_and_check(serve: Serve, how: str, drained: int = 0) -> None:
    """Stop `serve` by `how` (one of STOP_WAYS) and check that every process it started is gone within
    GONE_WITHIN_S of its exit, its output shows no crash, it exited 0 (unless SIGKILLed), its port no
    longer answers and its HAProxy folder is gone; with `drained` > 0, that many streams are in flight
    when it is stopped and each must finish whole."""
    assert how in STOP_WAYS, how
    results: list = []
    threads, started = [], []
    for _ in range(drained):  # all started at once; the signal waits until each has its first token
        started.append(threading.Event())
        threads.append(threading.Thread(target=stream, args=(serve.url, serve.key, results, started[-1])))
        threads[-1].start()
    for ev in started:
        ev.wait(120)
    procs = serve.tree()
    assert len(procs) > 5, [p.name() for p in procs]  # the relay, the driver, Ray's processes, HAProxy, ...
    folders = haproxy_folders({p.pid for p in procs})
    assert folders, "no HAProxy folder names one of the app's processes as its owner"
    if how == "sigint":
        serve.proc.send_signal(signal.SIGINT)
    elif how == "sigterm":
        serve.proc.send_signal(signal.SIGTERM)
    elif how == "sigterm-group":
        os.killpg(serve.proc.pid, signal.SIGTERM)
    elif how == "sigkill":
        serve.proc.kill()
    status = serve.proc.wait(timeout=180)
    left = survivors(procs, GONE_WITHIN_S)
    for t in threads:
        t.join(60)
    text = serve.text()
    assert not left, f"still running {GONE_WITHIN_S:g} s after `kvmesh serve` ({how}) exited: {left}\n{text[-2000:]}"
    for symptom in ("Aborted", "core dumped", "Failed to push error to driver"):
        assert symptom not in text, f"{how}: {symptom!r} in the output:\n{text[-3000:]}"
    if how != "sigkill":
        assert status == 0, text[-3000:]
    assert [r[:2] for r in results] == [(200, "length")] * drained, f"{how}: requests in flight were cut: {results}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{serve.url}/health", timeout=5)
    assert not [f for f in folders if f.exists()], f"{how}: the run's HAProxy folder was left behind: {folders}"

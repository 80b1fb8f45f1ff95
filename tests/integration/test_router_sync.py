"""Two ingress replicas, one placement view: a real `kvmesh serve` with `ingress_replicas: 2` (HAProxy spreads
connections over both), two engines. Each ingress's router finds the other through the registry actor,
their placement streams run over CURVE, a new prefix sent through both fronts at once lands on one
engine replica, and each router's count of the other's in-flight requests returns to zero."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import yaml
from paths import REPO_ROOT

pytestmark = pytest.mark.integration

PAIRS = 8
PREFIX_TOKENS = 640


def _start(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="kvsync-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "replicas": 2,
                "ingress_replicas": 2,
                "port": 0,
                "engine": {"model": "tiny", "block_size": 32, "max_model_len": 2048, "num_gpu_blocks_override": 512},
            }
        )
    )
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    out = open(tmp_path / "serve.out", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--config", str(cfg), "--num-cpus", "3"],
        cwd=REPO_ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, out, ray_tmp


def _stop(proc, out, ray_tmp) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out.close()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _states(url: str, headers: dict, want: int = 2, tries: int = 40) -> dict[str, dict]:
    """/kvmesh/state from each ingress replica (HAProxy picks one per connection), keyed by router id."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        with httpx.Client(timeout=30, headers=headers) as c:  # a new connection each time
            doc = c.get(url + "/kvmesh/state").json()
        sync = (doc.get("router") or {}).get("sync") or {}
        if sync.get("router"):
            seen[sync["router"]] = sync
        if len(seen) >= want:
            break
        time.sleep(0.25)
    return seen


def test_two_ingress_replicas_share_placements(tmp_path, tiny_model_dir):
    proc, out, ray_tmp = _start(tmp_path)
    try:
        url = key = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None and not (url and key):
            time.sleep(1)
            text = (tmp_path / "serve.out").read_text()
            m = re.search(r"kvmesh serving at (http://\S+)/v1", text)
            k = re.search(r"API key: (\S+)", text)
            url, key = (m.group(1) if m else None), (k.group(1) if k else None)
        assert url and key, (tmp_path / "serve.out").read_text()[-3000:]
        headers = {"Authorization": f"Bearer {key}"}

        def send(ids: list[int]) -> str:
            with httpx.Client(timeout=180, headers=headers) as c:  # own connection: HAProxy leastconn spreads them
                r = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r.headers["x-kvmesh-replica"]

        # warm up both fronts so both routers have started their sync and found each other
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(send, [[5, 6, 7, 8 + i] for i in range(8)]))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = _states(url, headers)
            if len(states) == 2 and all(s["peers"] for s in states.values()):
                break
            time.sleep(1)
        assert len(states) == 2, states
        a, b = states.values()
        assert a["peers"] == [b["router"]] and b["peers"] == [a["router"]], states

        together = 0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for k in range(PAIRS):
                prefix = [(k * 131 + i * 7919) % 1000 + 10 for i in range(PREFIX_TOKENS)]  # the tiny vocab: 1024
                got = list(pool.map(send, [prefix + [1, 2, 3], prefix + [4, 5, 6]]))
                together += got[0] == got[1]
        # the two requests of a pair go through different fronts at the same moment; each router decides
        # on the same synced view, so the prefix is computed on one replica
        assert together >= PAIRS - 1, together

        time.sleep(2)
        states = _states(url, headers)
        assert len(states) == 2, states
        for s in states.values():
            assert s["published"] > 0 and s["applied"] > 0, states
            assert s["peer_inflight"] == 0, states  # every peer request that finished was taken back
    finally:
        _stop(proc, out, ray_tmp)

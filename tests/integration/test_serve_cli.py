"""`kvmesh serve` as a user runs it: a subprocess that starts its own Ray, prints URL and API key,
answers OpenAI requests, and exits cleanly (status 0, no leftover processes) on SIGTERM."""

from __future__ import annotations

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
from paths import REPO_ROOT

pytestmark = pytest.mark.integration


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_kvmesh_serve_prints_url_and_key_serves_and_stops_on_sigterm(tmp_path, tiny_model_dir):
    ray_tmp = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    out = open(tmp_path / "serve.out", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--replicas", "1", "--port", "0", "--num-cpus", "2"],
        cwd=REPO_ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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
        h = {"Authorization": f"Bearer {key}"}
        r = httpx.post(
            url + "/v1/completions",
            headers=h,
            timeout=120,
            json={"model": "tiny", "prompt": "hello kvmesh", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 and r.headers["x-kvmesh-replica"]
        assert httpx.post(url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x"}).status_code == 401

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        deadline = time.monotonic() + 30
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_alive(proc.pid), "processes of `kvmesh serve` survived SIGTERM"
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)

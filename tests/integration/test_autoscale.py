"""Integration: Serve autoscales the engine deployment (config `autoscaling:`) from 1 replica to 3 under
load and back to 1 when it ends, with no failed request; the router takes the new replicas in once they
report (KV events subscribed) and drains the removed ones from its view.

Runs tests/integration/autoscale_check.py in a child process (its own Ray, apart from the session's live app)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_engines_scale_one_to_three_and_back_without_a_failed_request(tmp_path):
    script = Path(__file__).with_name("autoscale_check.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-3000:]
    found = json.loads(lines[-1])
    assert "error" not in found, found.get("trace") or found["error"]
    assert found["replicas_at_start"] == 1
    assert found["scaled_up"] and found["replicas_at_peak"] == 3
    assert found["replicas_serving_at_peak"] >= 2  # the new replicas got traffic once ready
    assert found["scaled_down"] and found["replicas_at_end"] == 1
    assert found["forgotten"] >= 2  # both removed replicas left the router's index and policy
    assert found["subscribers"] == 1  # and their KV-event subscriptions ended
    assert found["failed"] == 0, found["errors"]
    assert found["ok"] > 0

"""Two ingress replicas, one placement view: a real `kvmesh serve` with `ingress_replicas: 2` (HAProxy spreads
connections over both), two engines. Each ingress's router finds the other through the registry actor,
their placement streams run over CURVE, a new prefix sent through both fronts at once lands on one
engine replica, and each router's count of the other's in-flight requests returns to zero. The same app then
has its sockets checked (loopback only) and is stopped by SIGTERM to the serve process, which must leave
nothing running (tests/support/serve_process.py)."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest
import yaml
from ingress_routers import router_states
from serve_process import Serve, serves_on_loopback, stop_and_check, taken_port_refused

pytestmark = pytest.mark.integration

PAIRS = 8
PREFIX_TOKENS = 640


CONFIG = {
    "replicas": 2,
    "ingress_replicas": 2,
    "engine": {"model": "tiny", "block_size": 32, "max_model_len": 2048, "num_gpu_blocks_override": 512},
}


def _states(url: str, headers: dict) -> dict[str, dict]:
    """Each ingress replica's router sync section, keyed by router id."""
    return {rid: st["sync"] for rid, st in router_states(url, headers).items()}


def test_two_ingress_replicas_share_placements(tmp_path, tiny_model_dir):
    serve = Serve(tmp_path, "sync", yaml.safe_dump(CONFIG), ("--num-cpus", "3"))
    try:
        serve.wait_serving()
        url, key = serve.url, serve.key
        assert url and key
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

        # one scrape, whichever replica answers, holds both replicas' counters, each labelled with its
        # replica and each family once (a scrape reaching one replica would switch between their counters)
        for _ in range(2):
            page = httpx.get(url + "/metrics", timeout=30).text
            assert page.count("# TYPE kvmesh_requests_total counter") == 1, page[:2000]
            fronts = set(re.findall(r'^kvmesh_requests_total\{ingress="([^"]+)"', page, re.M))
            assert len(fronts) == 2, page[:2000]

        # the app as a service manager runs it: on loopback only, its port refused to a second serve, and a
        # SIGTERM to the serve process ends it and everything it started
        serves_on_loopback([serve])
        taken_port_refused(serve)
        stop_and_check(serve, "sigterm")
    finally:
        serve.cleanup()

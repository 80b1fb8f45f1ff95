"""Two ingress replicas, one placement view: a real `kvmesh serve` with `ingress_replicas: 2` (HAProxy spreads
connections over both), two engines. Each ingress's router finds the other through the registry actor,
their placement streams run over CURVE, a new prefix sent through both fronts at once lands on one
engine replica, and each router's count of the other's in-flight requests returns to zero. A tenant's
concurrency limit holds across both fronts (its requests in flight on the other ingress replica count). The
same app then has its sockets checked (loopback only) and is stopped by SIGTERM to the serve process, which
must leave nothing running (tests/support/serve_process.py)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import yaml
from ingress_routers import router_states
from polling import wait_for
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


LIMITED_CONCURRENCY = 2


def _tenants_file(tmp_path) -> tuple[str, str, str]:
    """A tenants file: `main` without limits, an operator (the placement checks) and `limited`, at most
    LIMITED_CONCURRENCY requests in flight. Returns (its path, main's key, limited's key)."""
    main, limited = (f"kvm-test-{secrets.token_hex(16)}" for _ in range(2))

    def entry(tenant_id: str, key: str, limits: dict | None, operator: bool = False) -> dict:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return {"id": tenant_id, "keys": [{"sha256": digest}], "limits": limits, "operator": operator}

    path = tmp_path / "tenants.yaml"
    limited_entry = entry("limited", limited, {"max_concurrent": LIMITED_CONCURRENCY})
    tenants = [entry("main", main, None, operator=True), limited_entry]  # main reads the routers' state
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return str(path), main, limited


def _concurrency_across_fronts(
    url: str, key: str, synced: Callable[[int], bool], requests: int = 8
) -> list[tuple[int, float, float]]:
    """Open `requests` long streams one after another, each on its own connection (HAProxy's leastconn sends
    them to alternate ingress replicas), and read each to its end. Before the next is sent, the fleet's view
    must hold every stream answered and still running: `synced(n)` polls until the fronts count all n (the
    placement stream's lag, milliseconds on an idle machine, is seconds on a starved one, and within it a
    front knows nothing of the other's admissions, as admission.py says). Returns (HTTP status, when it was
    answered, when its [DONE] arrived) per request, in the order sent."""
    results: list[tuple[int, float, float]] = [(0, 0.0, 0.0)] * requests
    statuses = [0] * requests
    finished = [False] * requests
    answered = threading.Semaphore(0)

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": [7, 8, 9, 10 + i], "max_tokens": 1800, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {key}"}
        try:
            client = httpx.Client(timeout=180, headers=headers)
            with client as c, c.stream("POST", url + "/v1/completions", json=body) as r:
                at = time.monotonic()
                statuses[i] = r.status_code
                answered.release()
                done = None
                for chunk in r.iter_bytes():
                    if done is None and b"[DONE]" in chunk:
                        # the ingress frees the request's slot right after writing [DONE], before it closes
                        # the stream: the connection's end reaches this client milliseconds after the slot
                        # may already be another request's
                        done = time.monotonic()
                results[i] = (r.status_code, at, done or time.monotonic())
        finally:
            finished[i] = True

    def running() -> int:
        return sum(1 for i in range(requests) if statuses[i] == 200 and not finished[i])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(requests)]
    for i, t in enumerate(threads):
        t.start()
        assert answered.acquire(timeout=120)
        time.sleep(0.15)  # a refused stream's connection closes first: leastconn then alternates the fronts
        if statuses[i] == 200:
            wait_for(lambda: synced(running()), "the other front's router to count the tenant's running streams")
    for t in threads:
        t.join(180)
    return results


def test_two_ingress_replicas_share_placements(tmp_path, tiny_model_dir):
    tenants, key, limited_key = _tenants_file(tmp_path)
    serve = Serve(tmp_path, "sync", yaml.safe_dump({**CONFIG, "tenants_file": tenants}), ("--num-cpus", "3"))
    try:
        serve.wait_serving()
        url = serve.url
        assert url
        serve.key = key  # the keys come from the tenants file: the checks below use main's
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

        # a tenant's concurrency limit is the fleet's, not each ingress replica's: with both fronts taking
        # turns, at most LIMITED_CONCURRENCY of its long requests run at once (per replica it would be twice
        # that), and requests sent while that many run are refused whichever front they reach
        def synced(running: int) -> bool:
            # the fronts the next connection may reach (leastconn: those with the fewest open) count every
            # stream running, their own and the other's
            fronts = router_states(url, headers, tries=2).values()
            return bool(fronts) and all(r["inflight"] + r["sync"]["peer_inflight"] == running for r in fronts)

        runs = _concurrency_across_fronts(url, limited_key, synced)
        served = [(a, b) for status, a, b in runs if status == 200]
        assert all(status in (200, 429) for status, _, _ in runs), runs
        overlap = max(sum(1 for a, b in served if a <= t < b) for t, _ in served)
        assert overlap == LIMITED_CONCURRENCY, f"{runs}"
        refused_while_full = [
            a
            for status, a, _ in runs
            if status == 429 and sum(1 for s, e in served if s <= a < e) == LIMITED_CONCURRENCY
        ]
        assert len(refused_while_full) >= 3, runs  # consecutive requests alternate between the two fronts

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

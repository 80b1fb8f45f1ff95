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
    "engine": {"model": "tiny", "block_size": 32, "max_model_len": 4096, "num_gpu_blocks_override": 512},
}


def _states(url: str, headers: dict) -> dict[str, dict]:
    """Each ingress replica's router sync section, keyed by router id."""
    return {rid: st["sync"] for rid, st in router_states(url, headers).items()}


LIMITED_CONCURRENCY = 2
REFUSALS = 6  # requests sent while the limited tenant's streams run, alternating between the fronts
DONE_LAG_S = 0.5  # how much later than the ingress's release a stream's end may reach its reading client


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


def _refusals_by_front(url: str) -> dict[str, int]:
    """The `limited` tenant's concurrency refusals per ingress replica, from the fleet's /metrics page."""
    page = httpx.get(url + "/metrics", timeout=30).text
    counts: dict[str, int] = {}
    for labels, value in re.findall(r"^kvmesh_tenant_rejections_total\{([^}]*)\} (\S+)$", page, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if got.get("tenant") == "limited" and got.get("reason") == "concurrency_limit_exceeded":
            counts[got["ingress"]] = int(float(value))
    return counts


class _LongStream:
    """A long stream of the limited tenant, read as it comes on a thread of its own (unread, it would stall, or
    the proxy's client timeout would cut it), until its end or until `stop` closes it as a client going away."""

    def __init__(self, url: str, key: str, i: int):
        self.answered = threading.Event()
        self.status = 0
        self.done_at: float | None = None  # when its end (its [DONE], or the connection's end) was read
        self._stop = threading.Event()
        body = {"model": "tiny", "prompt": [7, 8, 10 + i], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(url, key, body), daemon=True)
        self._thread.start()
        assert self.answered.wait(120), "a long stream was not answered"

    def _read(self, url: str, key: str, body: dict) -> None:
        try:
            with httpx.Client(timeout=180, headers={"Authorization": f"Bearer {key}"}) as c:
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    self.status = r.status_code
                    self.answered.set()
                    for chunk in r.iter_bytes():
                        if b"[DONE]" in chunk or self._stop.is_set():
                            break
        finally:
            self.done_at = time.monotonic()
            self.answered.set()

    def running(self) -> bool:
        return self.done_at is None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _fleet_wide_concurrency(url: str, key: str, synced: Callable[[int], bool]) -> None:
    """The `limited` tenant's concurrency limit holds across both fronts. LIMITED_CONCURRENCY long streams are
    opened one by one (leastconn puts the second on the other front), each once the fleet's view counts the
    ones before it (the placement stream's lag, milliseconds on an idle machine, seconds on a starved one: within
    it a front knows nothing of the other's admissions, as admission.py says). While they run, requests are
    refused, on both fronts; a stream its client closes frees its slot for the next request."""
    headers = {"Authorization": f"Bearer {key}"}
    streams: list[_LongStream] = []
    try:
        for i in range(LIMITED_CONCURRENCY):
            streams.append(_LongStream(url, key, i))
            assert streams[-1].status == 200, streams[-1].status
            wait_for(lambda: synced(len(streams)), "the fronts to count every running stream")
        before = _refusals_by_front(url)
        for i in range(REFUSALS):  # no other request meanwhile: it would take a turn of leastconn's alternation
            if not all(s.running() for s in streams):
                break
            with httpx.Client(timeout=60, headers=headers) as c:  # its own connection: leastconn alternates ties
                r = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, i], "max_tokens": 1})
            at = time.monotonic()
            if r.status_code == 200:  # only if a stream had ended: its client reads its end at most DONE_LAG_S later
                time.sleep(DONE_LAG_S)
                assert any(s.done_at is not None and s.done_at <= at + DONE_LAG_S for s in streams), (
                    f"admitted while {LIMITED_CONCURRENCY} of the tenant's streams ran: {r.text}"
                )
                break
            assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded", r.text
            time.sleep(0.15)
        refused = {front: n - before.get(front, 0) for front, n in _refusals_by_front(url).items()}
        assert len([n for n in refused.values() if n > 0]) == 2, f"refused per front while the streams ran: {refused}"
        streams.pop(0).stop()  # the client goes away: the ingress cancels the stream and frees its slot
        # the ingress hears of the client's going away at its next write through the proxy: seconds on a starved
        # machine (with the stream's own end, 4000 tokens, the latest it frees the slot)
        wait_for(lambda: synced(len(streams)), "the fronts to count the closed stream gone", timeout=120)
        with httpx.Client(timeout=60, headers=headers) as c:
            r = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        for stream in streams:
            stream.stop()


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

        # a tenant's concurrency limit is the fleet's, not each ingress replica's: per replica it would let twice
        # LIMITED_CONCURRENCY of its requests run
        def synced(running: int) -> bool:
            # the fronts the next connection may reach (leastconn: those with the fewest open) count every
            # request of the fleet running, their own and the other's
            fronts = router_states(url, headers, tries=2).values()
            return bool(fronts) and all(r["inflight"] + r["sync"]["peer_inflight"] == running for r in fronts)

        _fleet_wide_concurrency(url, limited_key, synced)

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

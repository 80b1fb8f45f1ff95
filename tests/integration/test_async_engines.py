"""The production engine path, live: vLLM's AsyncLLM (EngineCore in its own process, `engine_mode: async`,
what k8s/ deploys on GPUs) behind the kvmesh ingress and router, on the tiny model.

One Serve app with one async engine replica, behind an LMCache connector to its node's server, serves every
check here (its start-up is the cost: ~30 s for AsyncLLM on CPU). It runs next to the session's `live_app`
on the same Ray cluster, under route prefix /async; when the session app itself runs async engines
(`make test-gpu`), it is reused, and the LMCache check starts an app of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from collections.abc import Iterator

import httpx
import psutil
import pytest
from engine_mode import live_engine_overrides
from polling import wait_for
from side_app import side_app

pytestmark = pytest.mark.integration

BLOCK = 32
# one sequence of max_model_len fills the engine's cache (vLLM keeps one block aside): a few prompts push a
# prefix out to LMCache's host tier
NUM_BLOCKS = 65
MAX_MODEL_LEN = 2048
LMCACHE_CONFIG = {"l1_size_gb": 0.05, "chunk_size": BLOCK}
APP_NAME = "kvmesh-async"
_rng = random.Random(2026)


def fresh_tokens(n: int) -> list[int]:
    return [_rng.randrange(10, 1000) for _ in range(n)]


class AsyncApp:
    def __init__(self, url: str, headers: dict, lmcache: bool):
        self.url = url
        self.headers = headers
        self.lmcache = lmcache  # its engine has an LMCache connector (LMCACHE_CONFIG)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)


@pytest.fixture(scope="module")
def async_app(live_app):
    if live_app.config["engine"].get("engine_mode") == "async":
        yield AsyncApp(live_app.url, live_app.headers, lmcache=bool(live_app.config["engine"].get("lmcache")))
        return
    config = {
        "replicas": 1,
        "engine": {
            "model": "tiny",
            "block_size": BLOCK,
            "max_model_len": MAX_MODEL_LEN,
            "num_gpu_blocks_override": NUM_BLOCKS,
            **live_engine_overrides(),
            "engine_mode": "async",
            "lmcache": LMCACHE_CONFIG,
        },
    }
    with side_app(live_app, APP_NAME, "/async", config) as url:
        yield AsyncApp(url, live_app.headers, lmcache=True)


def complete(c: httpx.Client, prompt, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def router_state(c: httpx.Client) -> dict:
    state = c.get("/kvmesh/state").json()["router"]
    if state is None:  # the router is created with the first engine request
        complete(c, fresh_tokens(8), max_tokens=1)
        state = c.get("/kvmesh/state").json()["router"]
    return state


def test_the_replica_runs_vllms_async_engine(async_app):
    with async_app.client() as c:
        router_state(c)  # the router exists from the first request on
        # Serve collects a replica's routing stats on a period: right after start-up they can be empty
        stats = wait_for(
            lambda: (lambda st: st if st and all(s.get("num_blocks", 0) > 0 for s in st.values()) else None)(
                router_state(c)["routing_stats"]
            ),
            "the async replica's routing stats with its KV block count",
        )
    assert stats and all(s.get("num_blocks", 0) > 0 for s in stats.values())
    # only AsyncLLM's engine runs out of process: the in-process driver never reports kv usage this way
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
    info = handle.info.remote().result(timeout_s=60)
    assert info["driver"] == "AsyncDriver"


def test_completion_answers_with_usage(async_app):
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name=APP_NAME)
    before = handle.info.remote().result(timeout_s=60)["steps"]
    with async_app.client() as c:
        r = complete(c, fresh_tokens(40), max_tokens=6, ignore_eos=True)
    body = r.json()
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["prompt_tokens"] == 40
    # AsyncLLM's engine steps in its own process; the driver counts the steps it reports: one prefill and
    # five decodes at least (one replica in this app)
    after = handle.info.remote().result(timeout_s=60)["steps"]
    assert after - before >= 6


def test_repeated_prefix_reports_cached_tokens_and_the_prediction_matches(async_app):
    prefix = fresh_tokens(6 * BLOCK)
    with async_app.client() as c:
        first = complete(c, prefix + fresh_tokens(3))
        second = complete(c, prefix + fresh_tokens(5))
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK
    assert int(second.headers["x-kvmesh-predicted-cached-tokens"]) == 6 * BLOCK


def test_streaming_chat_sends_chunks_then_usage_then_done(async_app):
    """The reply streams as the engine makes it: a role chunk first, the text over several chunks, the
    finish reason on the last one, then the usage chunk and [DONE]. A replica that falls behind gets
    AsyncLLM's deltas merged (vLLM's per-request collector does that), so the reply is long enough
    (ignore_eos) that it cannot all be merged into one chunk unless the replica stalls for the whole
    generation."""
    n = 128
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello from the async engine " + str(_rng.random())}],
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
    }
    events = []
    with async_app.client() as c:
        with c.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        whole = c.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *replies, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n and last["usage"]["prompt_tokens"] > 0
    assert all(ch["choices"] and ch["usage"] is None for ch in replies)
    assert replies[0]["choices"][0]["delta"].get("role") == "assistant"
    finishes = [ch["choices"][0]["finish_reason"] for ch in replies]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    pieces = [ch["choices"][0]["delta"].get("content") or "" for ch in replies]
    assert sum(1 for p in pieces if p) > 2
    # the streamed text is the text of the same greedy request asked for whole
    assert "".join(pieces) == whole.json()["choices"][0]["message"]["content"]


def test_kv_events_from_the_engine_core_process_reach_the_router(async_app):
    """vLLM publishes KV events from AsyncLLM's EngineCore process; the router's subscriber must get
    them (blocks counted, no gaps), not only its own speculative entries."""
    with async_app.client() as c:
        state = router_state(c)
        rid = next(iter(state["routing_stats"]))
        wait_for(lambda: rid in router_state(c)["subscribers"], "the router to subscribe")
        before = router_state(c)["events"][rid]["blocks"]
        complete(c, fresh_tokens(5 * BLOCK), max_tokens=1)
        after = wait_for(
            lambda: (e := router_state(c)["events"][rid])["blocks"] >= before + 5 and e, "BlockStored events"
        )
    assert after["gaps"] == 0 and after["decode_errors"] == 0


def test_client_disconnect_mid_stream_aborts_the_async_engine_request(async_app):
    body = {"model": "tiny", "prompt": fresh_tokens(40), "max_tokens": 2000, "temperature": 0}
    body.update({"ignore_eos": True, "stream": True})

    def aborted(c) -> int:
        return sum(s.get("aborted", 0) for s in router_state(c)["routing_stats"].values())

    def idle(c) -> bool:
        state = router_state(c)
        return state["inflight"] == 0 and all(
            s.get("running", 0) + s.get("queued", 0) == 0 for s in state["routing_stats"].values()
        )

    with async_app.client(timeout=60) as c:
        before = aborted(c)
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        # closed after one event: AsyncLLM must drop the request, not generate 2000 tokens
        wait_for(lambda: idle(c) and aborted(c) == before + 1, "the engine to abort the request", timeout=60)


def test_vllm_metrics_leave_through_rays_metrics_port_under_the_dashboards_names(async_app):
    """Async engines publish vLLM's metrics through Ray (RayPrometheusStatLogger); the Grafana dashboard
    (k8s/monitoring) queries them as ray_vllm_*: they must appear so on Ray's metrics export port."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]
    ports = {(n["NodeManagerAddress"], n["MetricsExportPort"]) for n in nodes}
    assert ports
    with async_app.client() as c:
        complete(c, fresh_tokens(2 * BLOCK), max_tokens=2)

    def exported() -> str:
        for host, port in ports:
            try:
                text = httpx.get(f"http://{host}:{port}/metrics", timeout=10).text
            except httpx.HTTPError:
                continue
            if "ray_vllm_prefix_cache_queries_total" in text:
                return text
        return ""

    text = wait_for(exported, "vLLM's metrics on Ray's metrics port", timeout=90)
    assert "ray_vllm_time_to_first_token_seconds_bucket" in text and "ray_vllm_kv_cache_usage_perc" in text


@contextlib.contextmanager
def _async_lmcache_app(async_app, live_app) -> Iterator[tuple[httpx.Client, str, int]]:
    """A client of a one-replica async app whose engine has an LMCache connector, the app's name and its
    engine's block count: this module's app, or (when that is the session app, which has none) one of its own
    with a small cache."""
    if async_app.lmcache:
        with async_app.client() as c:
            yield c, APP_NAME, NUM_BLOCKS
        return
    blocks = 24
    config = {
        "replicas": 1,
        "engine": {
            "model": "tiny",
            "block_size": BLOCK,
            "max_model_len": 512,
            "num_gpu_blocks_override": blocks,
            "num_cpus": 0.1,  # beside the session's app on the test cluster
            **live_engine_overrides(),
            "engine_mode": "async",
            "lmcache": LMCACHE_CONFIG,
        },
    }
    with side_app(live_app, "kvmesh-async-lmcache", "/async-lmcache", config) as url:
        with httpx.Client(base_url=url, headers=live_app.headers, timeout=120) as c:
            yield c, "kvmesh-async-lmcache", blocks


def test_an_async_engine_with_lmcache_starts_in_serve_and_loads_a_prefix_from_the_host_tier(async_app, live_app):
    """The production engine (AsyncLLM in a Serve replica, so vLLM's metrics go through Ray's stat
    logger) with an LMCache connector: the connector's own histogram has no buckets, which Ray's
    Histogram refuses, and the engine failed to start. It starts, and a prefix pushed out of the engine's
    cache by other prompts comes back from LMCache's host tier, as the router predicted."""
    from ray import serve

    prompt = fresh_tokens(8 * BLOCK)
    with _async_lmcache_app(async_app, live_app) as (c, app, blocks):
        handle = serve.get_deployment_handle("EngineReplica", app_name=app)

        def loaded_through_lmcache() -> int:  # the one engine replica's tokens loaded through its KV connector
            return handle.info.remote().result(timeout_s=60)["external_hit_tokens"]

        assert complete(c, prompt, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for _ in range(blocks // 8 + 1):  # a cache's worth of other prompts: the first one's blocks go first
            complete(c, fresh_tokens(8 * BLOCK), max_tokens=1)
        before = loaded_through_lmcache()
        again = complete(c, prompt + fresh_tokens(5), max_tokens=1)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
        assert int(again.headers["x-kvmesh-predicted-cached-tokens"]) == 8 * BLOCK
        # all of it loaded through the connector, none of it found still in the engine's own cache (the count
        # follows the engine's step stats)
        loaded = wait_for(lambda: max(0, loaded_through_lmcache() - before), "the tokens loaded through LMCache")
        assert loaded == 8 * BLOCK


def _stream_text(r: httpx.Response, on_text=None) -> tuple[str, dict | None]:
    """The streamed text and the usage event of an SSE completion; `on_text()` after each text event."""
    parts, usage = [], None
    for line in r.iter_lines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            if choice.get("text"):
                parts.append(choice["text"])
                if on_text is not None:
                    on_text()
    return "".join(parts), usage


def test_an_async_replica_killed_mid_stream_is_finished_by_its_replacement_with_the_same_output(async_app):
    """A real `kill -9` of the replica process while it streams: AsyncLLM's engine core process dies with
    it, and the ingress continues the stream on another replica (with one replica, Serve's replacement)
    from the prompt plus the tokens already sent: the client sees the greedy text of an untouched run."""
    from kvmesh.benchmarks.failover_run import metric, pid_of, surviving

    body = {"model": "tiny", "prompt": fresh_tokens(64), "max_tokens": 400, "temperature": 0}
    body.update({"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    with async_app.client(timeout=600) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            reference, _ = _stream_text(r)
        before = metric(c, "kvmesh_migrations_total")
        killed: list[int] = []
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            pid = pid_of(c, r.headers["x-kvmesh-replica"])
            children = [p.pid for p in psutil.Process(pid).children(recursive=True)]

            def kill_once() -> None:
                if not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

            text, usage = _stream_text(r, kill_once)
        assert killed and children  # killed while streaming; the engine core ran in a process of its own
        assert text == reference
        assert usage is not None and usage["completion_tokens"] == 400
        assert metric(c, "kvmesh_migrations_total") >= before + 1
        assert not surviving(children, 30.0), children

"""An engine replica killed (a real `kill -9` of its process) while it streams: no request is lost.

One Serve app with 2 engine replicas (in-process engines; AsyncLLM with `KVMESH_TEST_ENGINE_MODE=async`),
next to the session's `live_app` on the same Ray cluster under route prefix /failover. The same 40
streaming requests (10 conversations x 4 turns, 4 at a time) run twice: once untouched, once with a
replica killed a third of the way in, while a stream generates on it. Every request of the second run
must succeed with the same greedy text and usage as in the first, the migrations must show in
/metrics, nothing the killed replica started may outlive it, and the router must forget the dead
replica and take Serve's replacement back cold.
"""

from __future__ import annotations

import time

import httpx
import pytest
from engine_mode import live_engine_overrides
from side_app import side_app

from kvmesh.benchmarks.failover_run import conversations, metric, replica_pids, run, surviving

pytestmark = pytest.mark.integration

APP_NAME = "kvmesh-failover"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def failover_app(live_app):
    config = {
        "replicas": 2,
        "max_migrations": 3,
        # two more engines beside the session app's: small CPU reservations so all of them fit
        "engine": {
            "model": "tiny",
            "max_model_len": 1024,
            "num_gpu_blocks_override": 512,
            "num_cpus": 0.1,
            **live_engine_overrides(),  # AsyncLLM engines (and GPUs) when `make test-gpu` asks for them
        },
    }
    with side_app(live_app, APP_NAME, "/failover", config) as url:
        yield url, live_app.headers


def _wait_for(predicate, what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)
    return value


def test_a_replica_killed_mid_stream_loses_no_request(failover_app):
    url, headers = failover_app
    convs = conversations(10, 4, seed=13)
    reference = run(url, headers, convs, concurrency=4, max_tokens=MAX_TOKENS)
    assert reference.failed == 0, [r.error for r in reference.results if not r.ok]
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        assert len(replica_pids(c)) == 2

    killed = run(url, headers, convs, concurrency=4, max_tokens=MAX_TOKENS, kill_at=1 / 3)

    assert killed.killed_pid is not None and killed.open_on_killed >= 1  # it died while streaming
    # nothing the killed replica started outlives it (AsyncLLM's engine core process, with async engines)
    assert not surviving(killed.killed_children, 30.0), killed.killed_children
    assert killed.failed == 0, [r.error for r in killed.results if not r.ok]
    for ref, got in zip(reference.results, killed.results):
        assert got.text == ref.text  # greedy output as without the failure
        assert (got.prompt_tokens, got.completion_tokens) == (ref.prompt_tokens, MAX_TOKENS)
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        # the stream whose token triggered the kill was generating there: at least it was moved
        assert metric(c, "kvmesh_migrations_total") >= 1
        dead = killed.killed_replica

        def router_state():
            return c.get("/kvmesh/state").json()["router"]

        # forgotten (index slot, subscriber, policy) within seconds: a call that broke on it made it suspect (Ray
        # says unavailable for a kill as for a blip), and the next probe a second later that Ray answers with its
        # death forgets it, unless Serve's own replica list dropped it first
        _wait_for(lambda: dead not in router_state()["replicas"], "the router to forget the killed replica", 5.0)
        assert metric(c, "kvmesh_router_replicas_forgotten_total") >= 1
        # Serve starts a replacement (a new replica id): the router adds it back, cold
        fresh = _wait_for(
            lambda: [r for r in replica_pids(c) if r != dead] if len(replica_pids(c)) == 2 else None,
            "Serve to replace the killed replica",
        )
        _wait_for(lambda: len([r for r in router_state()["replicas"] if r != dead]) == 2, "the router to add it")
        assert dead not in fresh

"""A placement ends exactly once, however its call ends: a caller cancelled after Serve gave it a replica (Serve
never reports that call complete), a rejected call's completion arriving after the retry was placed on the same
replica, a migrated request's earlier call completing after its new call was placed under the same request id,
and a replica that leaves with requests in flight. One replica whose KV-event stream cannot be opened does not
stop routing to the others."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from types import SimpleNamespace

from router_fakes import make_router

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger


@dataclasses.dataclass(frozen=True)
class RID:
    unique_id: str


def _replica(rid: str, **stats):
    return SimpleNamespace(
        replica_id=RID(rid),
        routing_stats=stats,
        node_id="n0",
        max_ongoing_requests=64,
        is_cross_language=False,
    )


def _request(ids, request_id: str, internal: str | None = None):
    req = {"request_id": request_id, "prompt_token_ids": ids, "cache_salt": "s", "tenant": "t1", "params": {}}
    meta = SimpleNamespace(internal_request_id=internal or "i-" + request_id)
    return SimpleNamespace(args=[req], kwargs={}, metadata=meta)


def _router():
    local_state.LEDGER = PredictionLedger()
    router = make_router(policy="kvmesh", block_size=32)
    sent: list[list] = []
    router.sync = SimpleNamespace(router_id="X", publish=sent.append, drain=lambda: None)
    return router, sent


async def _place(router, candidates, request, replica) -> None:
    """Rank `request` over `candidates`, then have Serve place it on `replica`."""
    await router.choose_replicas(candidates, request)
    router._routed(request, replica.replica_id)


async def _fleet_of_two():
    """A router over replicas A and B, both in Serve's set, and what it publishes to its peers."""
    router, sent = _router()
    a, b = _replica("A"), _replica("B")
    router.update_replicas([a, b])
    return router, sent, a, b


def _queued(router, replicas) -> dict[str, tuple[int, int]]:
    return {v.replica_id: (v.queued, v.pending_prefill_tokens) for v in router._views(replicas, {})}


def test_a_caller_cancelled_after_serve_chose_its_replica_ends_when_the_ingress_is_done():
    """Serve's own send path: the caller's cancel lands between the chosen replica and the send, so Serve sends
    nothing and reports nothing; the ingress's end of the request ends the placement."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest
    from ray.serve._private.router import AsyncioRouter

    async def run():
        router, sent = _router()
        router.request_end_grace_s = 0.01
        a, b = _replica("A", queued=0), _replica("B", queued=0)
        router._replicas = {a.replica_id: a, b.replica_id: b}
        router._replicas_list = [a, b]
        completed: list[str] = []
        serve_completed = router.on_request_completed
        router.on_request_completed = lambda rep, iid: (completed.append(iid), serve_completed(rep, iid))
        caller: asyncio.Task | None = None

        async def select(candidates, backoff_index):  # Serve's queue-length probe finds the replica free
            await asyncio.sleep(0)
            asyncio.get_running_loop().call_soon(caller.cancel)  # the client goes away right then
            return candidates[0]

        router._select_from_candidate_replicas = select

        @contextlib.contextmanager
        def queued(*args, **kwargs):
            yield

        async def resolved(pr):
            pr.resolved = True

        serve = SimpleNamespace(
            _resolve_args_with_metrics=resolved,
            _active_request_router=router,
            request_router=router,
            _metrics_manager=SimpleNamespace(wrap_queued_request=queued),
            _enable_strict_max_ongoing_requests=True,
        )
        req = _request(list(range(300)), "r1")
        pr = PendingRequest(
            args=req.args, kwargs={}, metadata=RequestMetadata(request_id="x", internal_request_id="i-r1")
        )
        caller = asyncio.create_task(AsyncioRouter._route_and_send_request_once(serve, pr, "resp", False))
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.02)
        assert completed == []  # Serve never reports the call: it was never sent
        assert sum(q for q, _ in _queued(router, [a, b]).values()) == 1  # still counted as load
        router.request_ended("r1")  # the ingress is done with it
        await asyncio.sleep(0.05)
        assert router._inflight == {} and router.unreported_ends == 1
        assert _queued(router, [a, b]) == {"A": (0, 0), "B": (0, 0)}
        assert [m[0] for m in sent][-1] == "done"  # the peers stop counting it too

    asyncio.run(run())


def test_a_request_serve_reported_complete_is_not_ended_again_by_the_ingress():
    async def run():
        router, sent = _router()
        router.request_end_grace_s = 0.01
        a = _replica("A")
        p = _request(list(range(300)), "q")
        await router.choose_replicas([a], p)
        router._routed(p, a.replica_id)
        router.first_token("q")
        router.on_request_completed(a.replica_id, "i-q")
        router.request_ended("q")
        await asyncio.sleep(0.05)
        assert router.unreported_ends == 0 and [m[0] for m in sent].count("done") == 1

    asyncio.run(run())


def test_a_rejected_calls_late_completion_does_not_end_its_retry_on_the_same_replica():
    async def run():
        router, sent = _router()
        a, b = _replica("A"), _replica("B")
        p = _request(list(range(500, 800)), "q")
        await router.choose_replicas([a, b], p)
        router._routed(p, a.replica_id)  # A rejects it
        await router.choose_replicas([a, b], p)  # Serve's retry...
        router._routed(p, a.replica_id)  # ...placed on A again, running there now
        router.on_request_completed(a.replica_id, "i-q")  # the rejected call's completion, late
        assert "i-q" in router._inflight and _queued(router, [a, b])["A"][0] == 1
        assert "done" not in [m[0] for m in sent]
        router.first_token("q")
        router.on_request_completed(a.replica_id, "i-q")  # the retry's own end
        assert router._inflight == {} and [m[0] for m in sent].count("done") == 1

    asyncio.run(run())


def test_a_migrated_requests_earlier_call_completing_late_leaves_its_new_call_counted():
    async def run():
        router, sent, a, b = await _fleet_of_two()
        ids = list(range(500, 800))
        await _place(router, [a, b], _request(ids, "q", internal="serve-1"), a)
        # re-sent under the same request id, a new Serve call
        await _place(router, [b], _request(ids, "q", internal="serve-2"), b)
        router.on_request_completed(a.replica_id, "serve-1")  # the dead call's completion, after
        assert [m[0] for m in sent].count("done") == 0  # the peers keep counting the request on B
        router.first_token("q")
        assert router._inflight["serve-2"].first_token  # the new call started: its prefill is done
        assert _queued(router, [b])["B"] == (0, 0)
        router.on_request_completed(b.replica_id, "serve-2")
        assert router._inflight == {} and [m[0] for m in sent].count("done") == 1

    asyncio.run(run())


def test_a_replica_that_leaves_takes_its_requests_in_flight_with_it():
    async def run():
        router, sent, a, b = await _fleet_of_two()
        await _place(router, [a], _request(list(range(300)), "q"), a)
        router.update_replicas([b])  # A is gone (scaled down, or died) before Serve reported the call
        assert router._inflight == {} and sent[-1][:4] == ["done", "X", "q", "A"]

    asyncio.run(run())


def test_one_replica_whose_event_stream_cannot_be_opened_does_not_stop_routing():
    async def run():
        router, _ = _router()
        router.subscribe_events = True
        a = _replica("A", queued=0)  # no KV-event stream: ready on its stats alone
        b = _replica("B", kv_events_endpoint="tcp://127.0.0.1", events_topic="kvmesh")  # a malformed endpoint
        router.update_replicas([a, b])
        for k in range(3):
            ranked = await router.choose_replicas([a, b], _request([k + 2] * 64, f"q{k}"))
            assert [g[0].replica_id.unique_id for g in ranked] == ["A"]  # B is not ready: not routed to
        assert router._subscribe_failed["B"][0] == 1  # tried once, then backing off
        router._subscribe_failed["B"] = (5000, 0.0)  # hours of failures: the back-off stays bounded, routing goes on
        ranked = await router.choose_replicas([a, b], _request([9] * 64, "late"))
        assert [g[0].replica_id.unique_id for g in ranked] == ["A"]
        failures, again_at = router._subscribe_failed["B"]
        assert failures == 5001 and again_at - time.monotonic() <= 32.0
        router.update_replicas([a])
        assert "B" not in router._subscribe_failed

    asyncio.run(run())


def test_a_replica_that_leaves_leaves_the_per_replica_metrics():
    """Under autoscaling every replica id ever seen would stay in /metrics and /kvmesh/state."""
    from kvmesh.deployments.serving_metrics import ServingMetrics

    async def run():
        router, _, a, b = await _fleet_of_two()
        serving = ServingMetrics()
        local_state.SERVING_METRICS.add(serving)
        for rid in ("A", "B"):
            serving.record(rid, 100, 50, 1, 0.1)
            local_state.LEDGER.predict(f"q-{rid}", rid, 50, 32)
            local_state.LEDGER.deliver(f"q-{rid}", 50)
        router.update_replicas([b])
        assert set(serving.per_replica) == {"B"} and set(local_state.LEDGER.per_replica) == {"B"}
        assert serving.total.requests == 2  # the totals keep what A served
        local_state.SERVING_METRICS.discard(serving)

    asyncio.run(run())


def test_calls_still_open_on_a_replica_that_left_are_abandoned_after_a_graceful_stop_would_have_ended_them(
    monkeypatch,
):
    """A frozen node's replica leaves Serve's set while its calls stay open, neither answering nor failing;
    those still open once a replica stopped on purpose would have finished are abandoned, to be moved."""
    from kvmesh.deployments import router as router_module

    monkeypatch.setattr(router_module, "ABANDON_AFTER_S", 0.05)

    async def run():
        router, _, a, b = await _fleet_of_two()
        await _place(router, [a], _request(list(range(300)), "q"), a)
        abandoned: list[str] = []
        local_state.OPEN_CALLS.watch("q", lambda: abandoned.append("q"))
        router.update_replicas([b])  # A left Serve's set; its call is still open
        await asyncio.sleep(0.01)
        assert abandoned == []  # not before a stopped replica's graceful end
        await asyncio.sleep(0.1)
        assert abandoned == ["q"] and len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())


def test_a_continuation_serve_never_reported_ends_with_the_request_the_ingress_admitted():
    """A stream continued on another replica mid-answer is routed under an id of its own (`continuation_id`),
    while the ingress says it is done with the id it admitted: the continuation's placement, never reported by
    Serve (its caller cancelled between Serve's choice and the send), ends with it, or it counts as its
    replica's load and its tenant's request for good."""
    from kvmesh.deployments.migration import continuation_id

    async def run():
        router, sent, a, b = await _fleet_of_two()
        router.request_end_grace_s = 0.01
        ids = list(range(300))
        await _place(router, [a, b], _request(ids, "q", internal="serve-1"), a)
        router.first_token("q")
        router.on_request_completed(a.replica_id, "serve-1")  # A died mid-stream: that call ended
        moved = continuation_id("q", 1)
        await _place(router, [b], _request(ids + [1, 2], moved, internal="serve-2"), b)  # never sent, never reported
        await _place(router, [b], _request([5] * 64, "other", internal="serve-3"), b)  # another request, in flight
        router.request_ended("q")
        await asyncio.sleep(0.05)
        return router, sent, moved

    router, sent, moved = asyncio.run(run())
    assert list(router._inflight) == ["serve-3"] and router.unreported_ends == 1
    assert sent[-1][:4] == ["done", "X", moved, "B"]  # the peers stop counting it too
    assert router._continuations == {}

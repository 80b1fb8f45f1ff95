"""Calls given up on a lost replica (deployments/replica_loss.py, the router's `_forget`, deployments/migration.py):
what the router sets to abandon a lost replica's calls abandons those calls only, not the new call of a request
sent again under the same request id; and a call given up by the router moves without its replica being reported
dead, also through Serve's real response classes, which turn the cancel into RequestCancelledError (no Ray
cluster: Serve's DeploymentResponse and DeploymentResponseGenerator over fake replica results)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator
from router_fakes import make_router

from kvmesh.deployments import local_state
from kvmesh.deployments import router as router_module
from kvmesh.deployments.failure_metrics import FailureCounters
from kvmesh.deployments.migration import MigratingStream, call_migrating
from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.replica_loss import OpenCalls

PROMPT = list(range(100, 400))
ANSWER = [11, 12, 13, 14, 15, 16]


@pytest.fixture(autouse=True)
def _own_state(monkeypatch):
    monkeypatch.setattr(local_state, "OPEN_CALLS", OpenCalls())
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())
    monkeypatch.setattr(router_module, "ABANDON_AFTER_S", 86400.0)  # never on its own: run by hand


@dataclasses.dataclass(frozen=True)
class _RID:
    unique_id: str


class _Replica(SimpleNamespace):
    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _replica(rid: str, node: str):
    return _Replica(replica_id=_RID(rid), routing_stats={"node_id": node}, node_id=node, max_ongoing_requests=64)


def _two_replicas():
    router = make_router(policy="kvmesh", block_size=32)
    a, b = _replica("A", "n0"), _replica("B", "n1")
    router.update_replicas([a, b])
    return router, a, b


def _abandon_timers() -> list:
    """What the router sets to run ABANDON_AFTER_S after it forgot a replica, kept to be run by hand (other
    timers run as usual)."""
    loop = asyncio.get_running_loop()
    real = loop.call_later
    timers: list = []

    def call_later(delay, callback, *args, context=None):
        if delay == router_module.ABANDON_AFTER_S:
            timers.append(lambda: callback(*args))
            return None
        return real(delay, callback, *args, context=context)

    loop.call_later = call_later
    return timers


async def _place(router, body: dict, internal: str, replica) -> None:
    """Serve placing a call of `body` on `replica` (every call of one ingress request under one internal id)."""
    pending = SimpleNamespace(args=[body], kwargs={}, metadata=SimpleNamespace(internal_request_id=internal))
    await router.choose_replicas([replica], pending)
    router._routed(pending, replica.replica_id)


def _request(request_id: str, max_tokens: int = len(ANSWER)) -> dict:
    return {"request_id": request_id, "prompt_token_ids": list(PROMPT), "params": {"max_tokens": max_tokens}}


async def _settle() -> None:
    """Let callbacks handed to the loop (an abandon's `call_soon_threadsafe`) and the tasks they wake run."""
    for _ in range(5):
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------- Serve's response classes
class _ReplicaResult:
    """What Serve's DeploymentResponse(Generator) awaits: one replica's answer to one call. Streams the rest of
    ANSWER after what the call's prompt already holds; `frozen_after`: chunks sent before its node froze (nothing
    more comes, cancelled or not, until `resume` is set, if given); `dies`: raises ActorDiedError once set, before
    any chunk."""

    def __init__(
        self,
        name: str,
        request: dict,
        frozen_after: int | None = None,
        dies: asyncio.Event | None = None,
        resume: asyncio.Event | None = None,
    ):
        done = len(request["prompt_token_ids"]) - len(PROMPT)
        self.todo = ANSWER[done : done + request["params"]["max_tokens"]]
        self.name, self.frozen_after, self.dies, self.resume = name, frozen_after, dies, resume
        self.i = 0
        self.waiting = asyncio.Event()  # the caller waits for a chunk that will not come
        self.cancelled = 0

    async def __anext__(self) -> dict:
        if self.dies is not None:
            await self.dies.wait()
            raise ActorDiedError()
        if self.frozen_after is not None and self.i >= self.frozen_after:
            self.waiting.set()
            await (self.resume or asyncio.Event()).wait()
        if self.i >= len(self.todo):
            raise StopAsyncIteration
        self.i += 1
        last = self.i == len(self.todo)
        token = self.todo[self.i - 1]
        return {
            "token_ids": [token],
            "text": f"<{token}>",
            "finish_reason": "length" if last else None,
            "num_cached_tokens": 0,
            "replica": self.name,
        }

    async def get_async(self) -> dict:
        if self.frozen_after is not None:
            self.waiting.set()
            await asyncio.Event().wait()
        return {"token_ids": list(self.todo), "replica": self.name}

    def cancel(self) -> None:
        self.cancelled += 1


def _serve(cls, result: _ReplicaResult, separate_loop: bool = False):
    """Serve's own response class over `result`, its replica already assigned; `separate_loop`: Serve's router on
    a loop of its own (kvmesh runs it on the caller's, SERVE_PATH_ENV)."""
    if separate_loop:
        fut: concurrent.futures.Future | asyncio.Future = concurrent.futures.Future()
    else:
        fut = asyncio.get_running_loop().create_future()
    fut.set_result(result)
    return cls(fut, SimpleNamespace(request_id="serve-id"), _is_router_running_in_separate_loop=separate_loop)


def _text_for(request, sent, delivered_chars):
    return SimpleNamespace(
        take=lambda token_ids, finished, stop_token: ("".join(f"<{t}>" for t in token_ids), len(token_ids)),
        stopped=None,
    )


def _migrating(request: dict, open_, replica_failed, max_migrations: int = 3) -> MigratingStream:
    return MigratingStream(
        request,
        open_,
        max_migrations=max_migrations,
        counters=FailureCounters(),
        replica_failed=replica_failed,
        first_token=lambda request_id: None,
        text_for=_text_for,
    )


# ------------------------------------------------------------------------------------------------ OpenCalls
def test_abandoning_a_call_leaves_a_later_call_under_the_same_request_id_alone():
    """A request moved before its first token is sent again under its own request id: what was meant for its
    call on a lost replica names that call, and must not give up the new one."""

    async def run():
        calls = local_state.OPEN_CALLS
        gone: list[str] = []
        first, second = (lambda: gone.append("first")), (lambda: gone.append("second"))
        calls.watch("q", first)
        on_a = calls.calls(["q", "not-open"])
        assert list(on_a) == ["q"]
        calls.unwatch("q", first)  # the call on A failed; the request is sent again under the same id
        calls.watch("q", second)
        assert calls.abandon_calls(on_a) == 0
        await _settle()
        assert gone == [] and len(calls) == 1
        assert calls.abandon_calls(calls.calls(["q"])) == 1  # the call open now still can be
        await _settle()
        assert gone == ["second"] and len(calls) == 0

    asyncio.run(run())


# ------------------------------------------------------------------------ the router's timer for a lost replica
def test_a_unary_request_moved_off_a_killed_replica_is_not_given_up_on_its_new_replica():
    """kill -9 of A: Serve tells the router of A's death while a unary request still has its call there; the call
    then fails, and the request is sent again, under the same request id, to B. When the timer the router set for
    A's calls runs, B's call goes on (it was given up: a 503 with max_migrations=1, a redo with more), while a
    call still open on A is abandoned."""

    async def run():
        timers = _abandon_timers()
        router, a, b = _two_replicas()
        on_a, killed, on_b, answer = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
        failed: list[str] = []

        async def call(body):
            if not on_a.is_set():
                await _place(router, body, "i-q", a)
                on_a.set()
                await killed.wait()
                raise ActorDiedError()
            await _place(router, body, "i-q", b)
            on_b.set()
            await answer.wait()
            return {"token_ids": ANSWER, "replica": "B"}

        counters = FailureCounters()
        task = asyncio.create_task(
            call_migrating(_request("q"), call, max_migrations=1, counters=counters, replica_failed=failed.append)
        )
        await on_a.wait()
        await _place(router, _request("r"), "i-r", a)  # another request, whose call to A never ends
        left_on_a: list[str] = []
        local_state.OPEN_CALLS.watch("r", lambda: left_on_a.append("r"))
        router.on_replica_actor_died(a.replica_id)
        killed.set()
        await on_b.wait()
        assert len(timers) == 1
        timers[0]()  # ABANDON_AFTER_S after A was forgotten
        await _settle()
        answer.set()
        out = await task
        assert out["replica"] == "B" and out["migrations"] == 1
        assert counters.snapshot()["migrations"] == {"unary": 1}
        assert left_on_a == ["r"] and failed == []

    asyncio.run(run())


def test_a_unary_request_sent_again_and_still_waiting_for_a_replica_is_not_given_up():
    """An autoscaler scale-down: Serve stops A while a long unary request runs there, its graceful stop ends by
    killing it, and the request is sent again under the same request id. Its new call, not placed yet when the
    timer for A's calls runs (it waits for a free replica), is not A's call and goes on."""

    async def run():
        timers = _abandon_timers()
        router, a, b = _two_replicas()
        on_a, killed, resent, free = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def call(body):
            if not on_a.is_set():
                await _place(router, body, "i-q", a)
                on_a.set()
                await killed.wait()
                raise ActorDiedError()
            resent.set()
            await free.wait()  # in Serve's queue: no replica free yet
            await _place(router, body, "i-q", b)
            return {"token_ids": ANSWER, "replica": "B"}

        task = asyncio.create_task(
            call_migrating(_request("q"), call, max_migrations=1, counters=FailureCounters(), replica_failed=print)
        )
        await on_a.wait()
        router.update_replicas([b])  # the autoscaler stops A
        killed.set()  # its graceful stop is over
        await resent.wait()
        assert len(timers) == 1
        assert timers[0]() == 0  # nothing of A's is still open
        await _settle()
        free.set()
        out = await task
        assert out["replica"] == "B" and out["migrations"] == 1

    asyncio.run(run())


def test_a_request_the_ingress_sent_again_before_the_router_heard_of_the_loss_keeps_its_new_call():
    """The ingress may see its call fail and send the request again (same request id, already watched) before
    Serve tells the router the replica died, which then still counts the request on it. Placed on B by the time
    the timer runs, the request's call is B's, and goes on."""

    async def run():
        timers = _abandon_timers()
        router, a, b = _two_replicas()
        resent, go, on_b, answer = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
        placed: list[str] = []

        async def call(body):
            if not placed:
                await _place(router, body, "i-q", a)
                placed.append("A")
                raise ActorDiedError()  # the ingress hears of it first
            resent.set()
            await go.wait()
            await _place(router, body, "i-q", b)
            placed.append("B")
            on_b.set()
            await answer.wait()
            return {"token_ids": ANSWER, "replica": "B"}

        task = asyncio.create_task(
            call_migrating(_request("q"), call, max_migrations=1, counters=FailureCounters(), replica_failed=print)
        )
        await resent.wait()
        router.on_replica_actor_died(a.replica_id)  # the router still has the request on A
        go.set()
        await on_b.wait()
        assert len(timers) == 1
        assert timers[0]() == 0
        await _settle()
        answer.set()
        out = await task
        assert out["replica"] == "B" and out["migrations"] == 1 and placed == ["A", "B"]

    asyncio.run(run())


def test_a_stream_moved_off_a_killed_replica_before_its_first_token_streams_on_and_its_new_replica_stays():
    """kill -9 of A while a stream waits for its first token there: it moves to B under the same request id and
    streams (Serve's real generator). The timer the router set for A's calls leaves B's stream alone; had it
    given it up, Serve's generator would have raised RequestCancelledError and B been reported dead too."""

    async def run():
        timers = _abandon_timers()
        router, a, b = _two_replicas()
        killed, resume = asyncio.Event(), asyncio.Event()
        results: list[_ReplicaResult] = []
        failed: list[str] = []

        def open_(body):
            if not results:
                results.append(_ReplicaResult("A", body, dies=killed))
            else:  # B pauses after its first chunk, until the timer has run
                results.append(_ReplicaResult("B", body, frozen_after=1, resume=resume))
            return _serve(DeploymentResponseGenerator, results[-1])

        def replica_failed(rid: str) -> None:  # notify_replica_failed
            failed.append(rid)
            router.replica_failed(rid)

        await _place(router, _request("q"), "i-q", a)
        stream = _migrating(_request("q"), open_, replica_failed)
        first = asyncio.ensure_future(stream.__anext__())
        await _settle()
        router.on_replica_actor_died(a.replica_id)
        killed.set()
        got = [(await first)["token_ids"][0]]
        await _place(router, _request("q"), "i-q", b)  # Serve placed the new call
        waiting = asyncio.ensure_future(stream.__anext__())
        await results[1].waiting.wait()
        assert len(timers) == 1
        timers[0]()  # ABANDON_AFTER_S after A was forgotten, B's call waiting for its next chunk
        await _settle()
        resume.set()
        got.append((await waiting)["token_ids"][0])
        got += [t async for chunk in stream for t in chunk["token_ids"]]
        assert got == ANSWER and stream.moves == 1 and stream.replica == "B"
        assert failed == [] and router._dead == {"A"} and "B" in router.index.replicas()
        assert results[1].cancelled == 0

    asyncio.run(run())


# ------------------------------------------------------------------------------ a call the router gave up
@pytest.mark.parametrize("separate_loop", [False, True], ids=["router-on-caller-loop", "router-on-own-loop"])
def test_a_stream_given_up_on_a_suspect_replica_moves_without_the_replica_reported_dead(separate_loop):
    """A replica suspect long enough has its calls given up (`_move_calls_off`); Serve's generator turns the
    cancel into RequestCancelledError, an Exception. The stream moves on as for a replica that left, and the
    replica, only frozen, is not reported failed: the router keeps it, so once it answers again it gets its
    traffic back."""

    async def run():
        router, a, b = _two_replicas()
        results: list[_ReplicaResult] = []
        failed: list[str] = []

        def open_(body):
            first = not results
            results.append(_ReplicaResult("A" if first else "B", body, frozen_after=2 if first else None))
            return _serve(DeploymentResponseGenerator, results[-1], separate_loop)

        await _place(router, _request("r1"), "i-r1", a)
        stream = _migrating(_request("r1"), open_, failed.append)
        got = [(await stream.__anext__())["token_ids"][0] for _ in range(2)]
        rest = asyncio.ensure_future(stream.__anext__())
        await results[0].waiting.wait()  # A froze: the stream waits for a chunk that will not come
        assert router._move_calls_off("A") == 1
        got.append((await rest)["token_ids"][0])
        got += [t async for chunk in stream for t in chunk["token_ids"]]
        assert got == ANSWER and stream.moves == 1 and results[0].cancelled == 1
        assert stream.counters.snapshot()["migrations"] == {"mid_stream": 1}
        assert failed == [] and router._dead == set() and "A" in router.index.replicas()
        assert rest.cancelling() == 0  # the cancel it took was ours, and taken back

    asyncio.run(run())


def test_a_unary_call_given_up_moves_without_its_replica_reported_dead_with_serves_response():
    """Serve's DeploymentResponse: abandoned, the call is cancelled while awaited and moves (its replica not
    reported failed); were the response itself cancelled too, Serve raises RequestCancelledError rather than
    CancelledError, and the call must move just the same, not fail the request."""

    async def run():
        for cancel_response in (False, True):
            local_state.OPEN_CALLS = OpenCalls()
            results: list[_ReplicaResult] = []
            responses: list[DeploymentResponse] = []
            failed: list[str] = []

            async def call(body):
                first = not results
                results.append(_ReplicaResult("A" if first else "B", body, frozen_after=0 if first else None))
                responses.append(_serve(DeploymentResponse, results[-1]))
                return await responses[-1]

            counters = FailureCounters()
            task = asyncio.create_task(
                call_migrating(_request("r1"), call, max_migrations=1, counters=counters, replica_failed=failed.append)
            )
            while not results:
                await asyncio.sleep(0)
            await results[0].waiting.wait()
            assert local_state.OPEN_CALLS.abandon(["r1"], movable_only=True) == 1
            if cancel_response:
                responses[0].cancel()
            out = await task
            assert out["token_ids"] == ANSWER and out["replica"] == "B" and out["migrations"] == 1, cancel_response
            assert counters.snapshot()["migrations"] == {"unary": 1} and failed == []
            assert task.cancelling() == 0 and len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())


def test_a_client_that_leaves_while_its_stream_is_given_up_ends_the_request():
    """The client's cancel and the router's land together on Serve's generator, which raises
    RequestCancelledError: the request ends (CancelledError), it is not moved."""

    async def run():
        results: list[_ReplicaResult] = []

        def open_(body):
            results.append(_ReplicaResult("B" if results else "A", body, frozen_after=None if results else 0))
            return _serve(DeploymentResponseGenerator, results[-1])

        stream = _migrating(_request("r1"), open_, print)
        waiting = asyncio.ensure_future(stream.__anext__())
        await results[0].waiting.wait()
        assert local_state.OPEN_CALLS.abandon(["r1"]) == 1
        waiting.cancel()  # the client goes away at the same moment
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert stream.moves == 0 and len(results) == 1
        stream.cancel()
        assert len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())


def test_a_dropped_replicas_calls_wait_out_its_drain_time_before_they_are_given_up():
    """Serve gives a replica it stops on purpose `engine.drain_timeout_s` to finish (60 s on GPU engines):
    the router gives up its open calls only after that and a margin, never while the drain still runs."""
    from kvmesh.deployments.app import router_kwargs
    from kvmesh.deployments.config import app_config
    from kvmesh.deployments.replica_loss import ABANDON_MARGIN_S

    kwargs = router_kwargs(app_config({"engine": {"model": "/models/m", "num_gpus": 1}}))
    assert kwargs["drain_timeout_s"] == 60.0  # a GPU engine's default drain time
    gpu = make_router(**{**kwargs, "policy": "kvmesh", "block_size": 32})
    assert gpu.abandon_left_after_s == 60.0 + ABANDON_MARGIN_S
    assert make_router(policy="kvmesh", block_size=32).abandon_left_after_s == router_module.ABANDON_AFTER_S

"""Request migration with kvmesh's engine-stream interface faked: what a continuation asks for, how one
stream is stitched from several replicas, and where the bound stops it (no Ray cluster, no vLLM)."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from kvmesh.deployments.engine_driver import EngineBroken
from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text
from kvmesh.deployments.migration import MigratingStream, MigrationExhausted, call_migrating, continuation

REQUEST = {
    "request_id": "r1",
    "prompt_token_ids": [5, 6, 7],
    "cache_salt": "salt-a",
    "tenant": "t",
    "params": {"max_tokens": 6, "min_tokens": 4, "temperature": 0.0},
}
ANSWER = [11, 12, 13, 14, 15, 16]  # what greedy decoding yields for REQUEST on any replica


class _Replica:
    """Streams the continuation of whatever it is asked, one token per chunk; dies after `die_after` chunks."""

    def __init__(self, name: str, die_after: int | None = None, error=None, held=()):
        self.name, self.die_after, self.error = name, die_after, error
        self.held = set(held)  # tokens whose text the detokenizer holds back until the next token
        self.requests: list[dict] = []
        self.cancelled = 0

    def open(self, request: dict):
        self.requests.append(request)
        done = len(request["prompt_token_ids"]) - len(REQUEST["prompt_token_ids"])
        todo = ANSWER[done : done + request["params"]["max_tokens"]]
        replica = self

        class _Stream:
            def __init__(self):
                self.i = 0
                self.pending: list[int] = []

            async def __anext__(self):
                if replica.die_after is not None and self.i >= replica.die_after:
                    raise replica.error or ActorDiedError()
                if self.i >= len(todo):
                    raise StopAsyncIteration
                self.i += 1
                last = self.i == len(todo)
                token = todo[self.i - 1]
                self.pending.append(token)
                text = ""
                if token not in replica.held or last:
                    text, self.pending = "".join(f"<{t}>" for t in self.pending), []
                return {
                    "token_ids": [token],
                    "text": text,
                    "finish_reason": "length" if last else None,
                    "num_cached_tokens": 0,
                    "replica": replica.name,
                }

            def cancel(self):
                replica.cancelled += 1

        return _Stream()


def _fleet(*replicas):
    """Serve's placement, faked: each new engine request goes to the next replica."""
    order = list(replicas)
    return lambda request: order.pop(0).open(request)


async def _drain(stream) -> list[int]:
    return [t async for chunk in stream for t in chunk["token_ids"]]


class _Text:
    """The ingress's detokenizer, faked like `_Replica`'s: a held token's text comes with the next one."""

    stopped = None

    def __init__(self, held, sent):
        self.held, self.pending = set(held), []
        self.text(sent)  # replays what the dead replica streamed

    def text(self, token_ids, finished=False) -> str:
        out = ""
        for t in token_ids:
            self.pending.append(t)
            if t not in self.held or t == ANSWER[-1]:
                out, self.pending = out + "".join(f"<{p}>" for p in self.pending), []
        return out

    def take(self, token_ids, finished=False, stop_token=False) -> tuple[str, int]:
        return self.text(token_ids, finished), len(token_ids)


def _stream(open_, counters, failed, started, max_migrations=2, held=()):
    texts: list[list[int]] = []

    def text_for(request, sent, delivered_chars):
        assert request == REQUEST
        texts.append(sent)
        return _Text(held, sent)

    return MigratingStream(
        dict(REQUEST),
        open_,
        max_migrations=max_migrations,
        counters=counters,
        replica_failed=failed.append,
        first_token=started.append,
        text_for=text_for,
    )


def test_a_continuation_asks_for_the_rest_from_the_prompt_plus_what_was_sent():
    c = continuation(REQUEST, [11, 12], 1)
    assert c["prompt_token_ids"] == [5, 6, 7, 11, 12]
    assert c["params"]["max_tokens"] == 4 and c["params"]["min_tokens"] == 2 and c["params"]["temperature"] == 0.0
    assert c["cache_salt"] == "salt-a" and c["tenant"] == "t" and c["request_id"] == "r1-m1"
    assert REQUEST["params"]["max_tokens"] == 6  # the original is untouched
    assert continuation(REQUEST, [], 1) is REQUEST  # nothing sent yet: the same request, routed again


@pytest.mark.parametrize("replayed", [True, False], ids=["ingress_text", "engine_text"])
def test_a_continuation_carries_stop_strings_only_when_the_engine_finds_them(replayed):
    """With the ingress replaying the text (a detokenizer from text_for) the ingress finds stop strings over
    the whole output, and the new replica's own text (which may hold the prompt's) is not searched: its
    continuation goes without them. Without one (no fast tokenizer) the engine keeps them."""
    a, b = _Replica("A", die_after=2), _Replica("B")
    request = {**REQUEST, "params": {**REQUEST["params"], "stop": ["User:"]}}
    stream = MigratingStream(
        request,
        _fleet(a, b),
        max_migrations=2,
        counters=FailureCounters(),
        replica_failed=lambda rid: None,
        first_token=lambda rid: None,
        text_for=lambda req, sent, delivered: _Text((), sent) if replayed else None,
    )
    assert asyncio.run(_drain(stream)) == ANSWER
    assert a.requests[0]["params"]["stop"] == ["User:"]  # the original request is the engine's to stop
    assert ("stop" in b.requests[0]["params"]) is not replayed
    assert b.requests[0]["params"]["max_tokens"] == 4 and request["params"]["stop"] == ["User:"]


def test_a_replica_dying_mid_stream_is_invisible_in_the_stitched_stream():
    counters, failed, started = FailureCounters(), [], []
    a, b = _Replica("A", die_after=2), _Replica("B")
    stream = _stream(_fleet(a, b), counters, failed, started)
    assert asyncio.run(_drain(stream)) == ANSWER
    assert b.requests[0]["prompt_token_ids"] == [5, 6, 7, 11, 12] and b.requests[0]["params"]["max_tokens"] == 4
    assert failed == ["A"] and started == ["r1-m1"] and a.cancelled == 1
    assert counters.snapshot() == {"migrations": {"mid_stream": 1}, "exhausted": 0}
    assert 'kvmesh_migrations_by_reason_total{reason="mid_stream"} 1' in failure_metrics_text(counters, None)


def test_a_replica_only_unavailable_mid_stream_is_moved_off_but_not_reported_dead():
    """Ray's ActorUnavailableError is "unavailable for now": Serve raises it for any gRPC UNAVAILABLE, a blip
    included, and its own router only probes again. The stream still moves, but the replica is reported
    suspect (left out until it answers a probe), not dead (left out for good while Serve lists it)."""
    from ray.exceptions import ActorUnavailableError

    counters, failed, started, unavailable = FailureCounters(), [], [], []
    blip = ActorUnavailableError(error_message="Actor is unavailable.", actor_id=None)
    a, b = _Replica("A", die_after=2, error=blip), _Replica("B")
    stream = _stream(_fleet(a, b), counters, failed, started)
    stream._replica_unavailable = unavailable.append
    assert asyncio.run(_drain(stream)) == ANSWER
    assert b.requests[0]["prompt_token_ids"] == [5, 6, 7, 11, 12] and started == ["r1-m1"]
    assert failed == [] and unavailable == ["A"]
    assert counters.snapshot() == {"migrations": {"mid_stream": 1}, "exhausted": 0}


def test_a_sum_over_the_migrations_family_is_the_migrations_not_twice_them():
    """The total and its split by reason are families of their own: in one, `sum(kvmesh_migrations_total)`
    counted every migration twice."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = FailureCounters()
    for reason in ("mid_stream", "before_first_token", "mid_stream"):
        counters.migrated(reason)
    families = {f.name: f for f in text_string_to_metric_families(failure_metrics_text(counters, None))}
    assert [(s.labels, s.value) for s in families["kvmesh_migrations"].samples] == [({}, 3)]
    by_reason = {s.labels["reason"]: s.value for s in families["kvmesh_migrations_by_reason"].samples}
    assert by_reason == {"before_first_token": 1, "mid_stream": 2}
    assert families["kvmesh_migrations_by_reason"].type == "counter"


def test_a_continuation_takes_its_text_from_the_ingress_not_from_the_new_replica():
    """The dead replica handed over 11 and 12, but 12's text (a character's first byte) was held back:
    the continuation's prompt ends after 12, and its text is the ingress's replay of the dead replica's
    detokenizer (12's text arrives with 13's), whatever text the new replica sends."""
    counters, failed, started = FailureCounters(), [], []
    a = _Replica("A", die_after=2, held={12})
    b = _Replica("B", held={12})
    b_open = b.open
    b.open = lambda request: _Garbled(b_open(request))  # the new replica's text is not to be trusted
    chunks = asyncio.run(_chunks(_stream(_fleet(a, b), counters, failed, started, held={12})))
    assert b.requests[0]["prompt_token_ids"] == [5, 6, 7, 11, 12] and b.requests[0]["params"]["max_tokens"] == 4
    assert [t for c in chunks for t in c["token_ids"]] == ANSWER  # each id once
    assert "".join(c["text"] for c in chunks) == "".join(f"<{t}>" for t in ANSWER)  # each text once


def test_a_stop_string_the_ingress_finds_after_a_move_ends_the_stream_there():
    """A stop string in the continuation's text (one spanning the move, which the new replica cannot see)
    ends the stitched stream with finish_reason stop, and the new replica's request is cancelled."""

    class _Stops(_Text):
        def text(self, token_ids, finished=False) -> str:
            out = super().text(token_ids, finished)
            if 14 in token_ids:
                self.stopped = "<14>"
                return out.replace("<14>", "")
            return out

    a, b = _Replica("A", die_after=2), _Replica("B")
    stream = _stream(_fleet(a, b), FailureCounters(), [], [])
    stream._text_for = lambda request, sent, delivered: _Stops((), sent)
    chunks = asyncio.run(_chunks(stream))
    assert [t for c in chunks for t in c["token_ids"]] == [11, 12, 13, 14]
    assert chunks[-1]["finish_reason"] == "stop" and b.cancelled == 1
    assert "".join(c["text"] for c in chunks) == "<11><12><13>"


class _Garbled:
    """A stream whose chunks carry the prompt's text again (what vLLM's detokenizer may do)."""

    def __init__(self, stream):
        self.stream = stream

    async def __anext__(self):
        chunk = await self.stream.__anext__()
        return {**chunk, "text": "<prompt again>" + chunk["text"]}

    def cancel(self):
        self.stream.cancel()


async def _chunks(stream) -> list[dict]:
    return [chunk async for chunk in stream]


def test_a_broken_engine_before_the_first_token_routes_the_request_again():
    counters, failed, started = FailureCounters(), [], []
    broken = _Replica("A", die_after=0, error=EngineBroken("engine step failed", "A"))
    b = _Replica("B")
    assert asyncio.run(_drain(_stream(_fleet(broken, b), counters, failed, started))) == ANSWER
    assert b.requests[0] is not None and b.requests[0]["request_id"] == "r1"
    assert failed == ["A"] and started == []
    assert counters.snapshot()["migrations"] == {"before_first_token": 1}


def test_after_max_migrations_the_request_ends_with_a_503():
    counters, failed, started = FailureCounters(), [], []
    dying = [_Replica(n, die_after=1) for n in "ABC"]
    stream = _stream(_fleet(*dying), counters, failed, started, max_migrations=2)
    with pytest.raises(MigrationExhausted) as info:
        asyncio.run(_drain(stream))
    assert info.value.status == 503 and info.value.body()["error"]["code"] == "engine_unavailable"
    assert counters.snapshot() == {"migrations": {"mid_stream": 2}, "exhausted": 1}


def test_a_stream_under_a_grammar_is_moved_before_its_first_token_but_not_continued_mid_stream():
    """A continuation would start the grammar again after the tokens sent (its output would not match it): a
    structured-output stream whose replica dies mid-answer ends with the 503; one that had sent nothing moves."""
    grammar = {**REQUEST, "params": {**REQUEST["params"], "structured_outputs": {"choice": ["yes", "no"]}}}

    def opened(fleet):
        return MigratingStream(
            dict(grammar),
            fleet,
            max_migrations=2,
            counters=counters,
            replica_failed=failed.append,
            first_token=started.append,
            text_for=lambda *_: None,
        )

    counters, failed, started = FailureCounters(), [], []
    b = _Replica("B")
    with pytest.raises(MigrationExhausted):
        asyncio.run(_drain(opened(_fleet(_Replica("A", die_after=2), b))))
    assert b.requests == [] and counters.snapshot() == {"migrations": {}, "exhausted": 1}
    counters, failed, started = FailureCounters(), [], []
    b = _Replica("B")
    assert asyncio.run(_drain(opened(_fleet(_Replica("A", die_after=0), b)))) == ANSWER
    assert b.requests[0]["params"]["structured_outputs"] == {"choice": ["yes", "no"]}


def test_a_bad_request_is_not_migrated():
    counters = FailureCounters()
    bad = _Replica("A", die_after=0, error=ValueError("prompt too long"))
    with pytest.raises(ValueError):
        asyncio.run(_drain(_stream(_fleet(bad, _Replica("B")), counters, [], [])))
    assert counters.snapshot()["migrations"] == {}


def test_a_unary_call_is_sent_again_whole():
    counters, failed = FailureCounters(), []
    calls = []

    async def call(request):
        calls.append(request)
        if len(calls) == 1:
            raise EngineBroken("engine step failed", "A")
        return {"token_ids": ANSWER, "replica": "B"}

    out = asyncio.run(
        call_migrating(dict(REQUEST), call, max_migrations=1, counters=counters, replica_failed=failed.append)
    )
    assert out["token_ids"] == ANSWER and calls[1]["prompt_token_ids"] == REQUEST["prompt_token_ids"]
    assert failed == ["A"] and counters.snapshot()["migrations"] == {"unary": 1}


def test_the_dead_replica_is_named_through_rays_wrapper_of_a_broken_engine():
    """A unary call's EngineBroken reaches the ingress wrapped by Ray (RayTaskError(EngineBroken)): the
    replica it names must still be found, or the router keeps choosing the broken replica and the
    request burns its migrations on it."""
    from ray.exceptions import RayTaskError

    from kvmesh.deployments.migration import replica_failure

    try:
        raise EngineBroken("engine step failed", "rep-A")
    except EngineBroken as exc:
        wrapped = RayTaskError("generate_full", "traceback", exc).as_instanceof_cause()
    assert isinstance(wrapped, EngineBroken)
    assert replica_failure(wrapped) == (True, "rep-A")
    assert replica_failure(EngineBroken("engine step failed", "rep-B")) == (True, "rep-B")


class _Frozen(_Replica):
    """A replica on a frozen node: its calls never answer and never fail."""

    def open(self, request: dict):
        self.requests.append(request)
        replica = self

        class _Stream:
            async def __anext__(self):
                await asyncio.Event().wait()

            def cancel(self):
                replica.cancelled += 1

        return _Stream()


def test_a_stream_whose_replica_left_the_fleet_silently_is_finished_elsewhere_when_abandoned():
    """A frozen node's calls neither answer nor fail; the router abandons what is still open on a replica it
    forgot (replica_loss.py), and the stream goes on on another replica, invisibly."""
    from kvmesh.deployments import local_state

    async def run():
        counters, failed, started = FailureCounters(), [], []
        a, b = _Frozen("A"), _Replica("B")
        stream = _stream(_fleet(a, b), counters, failed, started)
        task = asyncio.create_task(_drain(stream))
        await asyncio.sleep(0.05)
        assert not task.done() and local_state.OPEN_CALLS.abandon(["r1"]) == 1
        assert await asyncio.wait_for(task, 5) == ANSWER
        assert a.cancelled >= 1 and b.requests[0]["prompt_token_ids"] == REQUEST["prompt_token_ids"]
        assert counters.snapshot()["migrations"] == {"before_first_token": 1}
        assert len(local_state.OPEN_CALLS) == 0  # nothing left watched once the stream ended

    asyncio.run(run())


class _FrozenAfter(_Replica):
    """A replica whose node froze after `sent` chunks of its call: nothing more comes, cancelled or not (a
    cancel never reaches a frozen actor)."""

    def __init__(self, name: str, sent: int):
        super().__init__(name)
        self.sent = sent

    def open(self, request: dict):
        inner = super().open(request)
        replica = self

        class _Stream:
            i = 0

            async def __anext__(self):
                if self.i >= replica.sent:
                    await asyncio.Event().wait()
                self.i += 1
                return await inner.__anext__()

            def cancel(self):
                replica.cancelled += 1

        return _Stream()


def test_a_stream_abandoned_between_two_chunks_moves_at_its_next_wait():
    """The router gives the call up while the ingress is not waiting on it (writing a chunk to a slow client):
    the next wait moves the stream on (before, it waited on the cancelled call to the frozen node for good,
    no longer watched, so nothing could give it up again)."""
    from kvmesh.deployments import local_state

    async def run():
        counters, failed, started = FailureCounters(), [], []
        a, b = _FrozenAfter("A", sent=2), _Replica("B")
        stream = _stream(_fleet(a, b), counters, failed, started)
        got = [t for _ in range(2) for t in (await stream.__anext__())["token_ids"]]
        assert local_state.OPEN_CALLS.abandon(["r1"]) == 1  # between two waits
        rest = asyncio.ensure_future(_drain(stream))
        done, _ = await asyncio.wait({rest}, timeout=5)
        assert done, "the abandoned stream still waits on the frozen replica"
        assert got + rest.result() == ANSWER
        assert counters.snapshot()["migrations"] == {"mid_stream": 1} and len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())


def test_a_unary_call_whose_replica_left_the_fleet_silently_is_sent_again_when_abandoned():
    from kvmesh.deployments import local_state

    async def run():
        counters, calls = FailureCounters(), []

        async def call(request):
            calls.append(request)
            if len(calls) == 1:
                await asyncio.Event().wait()  # the frozen node's replica
            return {"token_ids": ANSWER, "replica": "B"}

        task = asyncio.create_task(
            call_migrating(dict(REQUEST), call, max_migrations=1, counters=counters, replica_failed=lambda r: None)
        )
        await asyncio.sleep(0.05)
        assert local_state.OPEN_CALLS.abandon(["r1"]) == 1
        out = await asyncio.wait_for(task, 5)
        assert out["token_ids"] == ANSWER and out["migrations"] == 1  # the ledger does not judge its prediction
        assert counters.snapshot()["migrations"] == {"unary": 1} and len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())


def test_a_client_that_leaves_while_its_call_is_abandoned_still_ends_the_request():
    from kvmesh.deployments import local_state

    async def run():
        async def call(request):
            await asyncio.Event().wait()

        task = asyncio.create_task(
            call_migrating(dict(REQUEST), call, max_migrations=1, counters=FailureCounters(), replica_failed=print)
        )
        await asyncio.sleep(0.05)
        task.cancel()  # the client went away
        local_state.OPEN_CALLS.abandon(["r1"])
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())


def test_the_origin_of_a_continuation_id_is_the_request_it_finishes():
    from kvmesh.deployments.migration import continuation_id, origin_id

    assert origin_id(continuation_id("0f3a", 1)) == "0f3a" and origin_id(continuation_id("q", 12)) == "q"
    for own in ("0f3a", "a-m", "a-mx", "-m1", "a-m１"):  # not a continuation's: its own
        assert origin_id(own) == own


def test_a_call_is_watched_as_movable_only_while_its_request_has_a_move_left():
    """What the router's suspect-replica watch reads (`OpenCalls.abandon(..., movable_only=True)`): a request
    with no move left is not given up there, so it waits for its replica instead of failing with a 503."""
    from kvmesh.deployments import local_state

    async def run():
        for max_migrations, movable in ((0, False), (1, True)):

            async def call(request):
                await asyncio.Event().wait()

            task = asyncio.create_task(
                call_migrating(
                    dict(REQUEST), call, max_migrations=max_migrations, counters=FailureCounters(), replica_failed=print
                )
            )
            await asyncio.sleep(0.02)
            assert local_state.OPEN_CALLS.abandon(["r1"], movable_only=True) == int(movable), max_migrations
            if not movable:
                assert local_state.OPEN_CALLS.abandon(["r1"]) == 1  # its replica was dropped: given up anyway
            with pytest.raises(MigrationExhausted if not movable else asyncio.CancelledError):
                if movable:
                    task.cancel()  # moved: its next call waits too; the client leaves
                await task
            assert len(local_state.OPEN_CALLS) == 0

        a = _FrozenAfter("A", sent=1)
        stream = _stream(_fleet(a), FailureCounters(), [], [], max_migrations=0)
        await stream.__anext__()
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.02)
        assert local_state.OPEN_CALLS.abandon(["r1"], movable_only=True) == 0  # a stream with no move left waits
        waiting.cancel()  # the client leaves: the ingress cancels the stream
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stream.cancel()
        assert len(local_state.OPEN_CALLS) == 0

    asyncio.run(run())

"""The drivers' shared load bookkeeping (`_LoadCounter.track`) on a fake engine stream: no vLLM needed."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from kvmesh.deployments.engine_driver import _LoadCounter


def _engine(n: int, log: list, fail_at: int | None = None, gate: asyncio.Event | None = None):
    async def outputs():
        try:
            if gate is not None:
                await gate.wait()
            for i in range(n):
                if i == fail_at:
                    raise ValueError("engine rejected the request")
                yield SimpleNamespace(finished=i == n - 1)
        finally:
            log.append("closed")

    return outputs()


def _state(load: _LoadCounter) -> tuple[int, int, int]:
    return load.queued, load.running, load.aborted


def test_a_finished_stream_leaves_nothing_counted():
    async def go():
        load, log, abandoned = _LoadCounter(), [], []
        stream = load.track(_engine(3, log), on_abandon=lambda: abandoned.append(1))
        seen = []
        async for out in stream:
            seen.append(_state(load))
        return seen, _state(load), log, abandoned

    seen, after, log, abandoned = asyncio.run(go())
    assert seen == [(0, 1, 0)] * 3 and after == (0, 0, 0) and log == ["closed"] and abandoned == []


def test_a_stream_left_early_is_aborted_and_the_engine_told():
    async def go():
        load, log, abandoned = _LoadCounter(), [], []
        stream = load.track(_engine(3, log), on_abandon=lambda: abandoned.append(1))
        await stream.__anext__()
        await stream.aclose()  # the client went away after the first token
        return _state(load), log, abandoned

    assert asyncio.run(go()) == ((0, 0, 1), ["closed"], [1])


def test_a_request_cancelled_while_queued_is_aborted():
    async def go():
        load, log, abandoned = _LoadCounter(), [], []
        stream = load.track(_engine(3, log, gate=asyncio.Event()), on_abandon=lambda: abandoned.append(1))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        queued = _state(load)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return queued, _state(load), log, abandoned

    assert asyncio.run(go()) == ((1, 0, 0), (0, 0, 1), ["closed"], [1])


def test_an_engine_error_is_raised_and_not_counted_as_an_abort():
    async def go():
        load, log, abandoned = _LoadCounter(), [], []
        stream = load.track(_engine(3, log, fail_at=1), on_abandon=lambda: abandoned.append(1))
        with pytest.raises(ValueError, match="rejected"):
            async for _ in stream:
                pass
        return _state(load), log, abandoned

    assert asyncio.run(go()) == ((0, 0, 0), ["closed"], [])


class _FakeLLMEngine:
    """Just enough of vLLM's LLMEngine for InprocDriver's thread: each request yields `steps` outputs."""

    def __init__(self, steps: int):
        self.steps, self.left, self.aborted, self.calls = steps, {}, [], 0
        self.priorities: dict = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def add_request(self, rid, prompt, params, priority=0):
        if prompt.get("bad"):
            raise ValueError("prompt too long")
        self.left[rid] = self.steps
        self.priorities[rid] = priority

    def abort_request(self, rids):
        for rid in rids:
            self.aborted.append(rid)
            self.left.pop(rid, None)

    def step(self):
        self.calls += 1
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(SimpleNamespace(request_id=rid, finished=self.left[rid] == 0))
            if self.left[rid] == 0:
                del self.left[rid]
        return outs


def _inproc(engine):
    from kvmesh.deployments.engine_driver import InprocDriver

    d = InprocDriver.__new__(InprocDriver)  # skip vLLM: the thread and queues are what is tested
    d.engine, d.load, d._ops, d._streams, d._stop = engine, _LoadCounter(), queue.SimpleQueue(), {}, False
    d._thread = threading.Thread(target=d._run, daemon=True)
    d._thread.start()
    return d


def test_inproc_driver_finishes_aborts_and_reports_engine_errors():
    engine = _FakeLLMEngine(steps=3)
    d = _inproc(engine)

    async def go():
        done = [out.finished async for out in d.generate({}, None, "a", priority=-3)]
        stream = d.generate({}, None, "b")
        await stream.__anext__()
        await stream.aclose()
        with pytest.raises(ValueError, match="too long"):
            async for _ in d.generate({"bad": True}, None, "c"):
                pass
        return done

    try:
        assert asyncio.run(go()) == [False, False, True]
        for _ in range(100):  # the abort travels through the engine thread's queue
            if engine.aborted:
                break
            time.sleep(0.01)
        assert engine.aborted == ["b"] and _state(d.load) == (0, 0, 1) and d._streams == {}
        assert engine.priorities == {"a": -3, "b": 0}  # a request's priority reaches vLLM's add_request
        # every step the engine ran is counted ("a" took 3, "b" at least 1 before its abort)
        assert d.steps == engine.calls >= 4
    finally:
        d._ops.put(("stop",))
        d._thread.join(timeout=5)


class _LookupWaitEngine(_FakeLLMEngine):
    """A request that waits `lookup_s` for its KV connector's lookup: until then a step runs nothing
    (no output, nothing running), as vLLM's scheduler does while LMCache has not answered."""

    def __init__(self, lookup_s: float):
        super().__init__(steps=1)
        self.lookup_s, self.added_at = lookup_s, {}
        self.running: list = []  # read through the driver's `_sched`, like vLLM's scheduler's

    def add_request(self, rid, prompt, params, priority=0):
        super().add_request(rid, prompt, params, priority)
        self.added_at[rid] = time.monotonic()

    def has_requests(self) -> bool:  # the scheduler's: what the driver asks an idle engine
        return bool(self.left)

    def step(self):
        self.calls += 1
        ready = [rid for rid in self.left if time.monotonic() - self.added_at[rid] >= self.lookup_s]
        for rid in ready:
            del self.left[rid]
        return [SimpleNamespace(request_id=rid, finished=True) for rid in ready]


def test_a_request_waiting_on_its_connector_is_polled_not_spun():
    """While a request's lookup is unanswered the engine steps at a bounded rate (a step per wait doubling
    up to STALL_MAX_WAIT_S), and only the step that served it is counted; stepping without pause ran
    ~10^5 empty steps in the same 0.3 s and held the GIL the connector needs to receive its answer."""
    from kvmesh.deployments.engine_driver import STALL_MAX_WAIT_S

    engine = _LookupWaitEngine(lookup_s=0.3)
    d = _inproc(engine)
    d._sched = engine

    async def go():
        return [out.finished async for out in d.generate({}, None, "a")]

    try:
        assert asyncio.run(asyncio.wait_for(go(), 5)) == [True]
        assert engine.calls <= 2 * 0.3 / STALL_MAX_WAIT_S + 20, engine.calls
        assert d.steps == 1
    finally:
        d._ops.put(("stop",))
        d._thread.join(timeout=5)


def test_a_second_request_under_an_id_in_flight_is_refused_and_the_first_goes_on():
    """vLLM and the driver key a request's outputs by its id: a second one under the same id would take
    the first's outputs, and leaving either would abort both (the first's consumer then waits forever)."""
    from kvmesh.deployments.engine_driver import RequestInFlight

    engine = _FakeLLMEngine(steps=4)
    d = _inproc(engine)

    async def go():
        first = d.generate({}, None, "r")
        await first.__anext__()
        with pytest.raises(RequestInFlight, match="already in flight"):
            await d.generate({}, None, "r").__anext__()
        rest = [out.finished async for out in first]
        assert rest and rest[-1]
        assert d.load.aborted == 0
        again = [out.finished async for out in d.generate({}, None, "r")]  # the id is free again
        assert again[-1]

    try:
        asyncio.run(asyncio.wait_for(go(), 10))
    finally:
        d._ops.put(("stop",))
        d._thread.join(timeout=5)


def test_the_step_thread_is_named_in_the_os():
    """`top -H` and the CPU split tell vLLM's work in a replica by this name, not the Ray worker's title."""
    from kvmesh.cluster.thread_names import os_thread_name

    d = _inproc(_FakeLLMEngine(steps=1))
    try:
        assert asyncio.run(asyncio.wait_for(d.call(lambda engine: 1), 5)) == 1  # the thread is running
        assert os_thread_name(d._thread.native_id) == "kvmesh-step"
    finally:
        d._ops.put(("stop",))
        d._thread.join(timeout=5)


def test_inproc_driver_call_returns_and_raises():
    # call(fn) runs fn on the engine thread; its result, or the exception it raised, reaches the caller
    d = _inproc(_FakeLLMEngine(steps=1))

    def boom(engine):
        raise RuntimeError("boom")

    async def go():
        assert await asyncio.wait_for(d.call(lambda engine: 42), 5) == 42
        with pytest.raises(RuntimeError, match="boom"):
            await asyncio.wait_for(d.call(boom), 5)

    try:
        asyncio.run(go())
    finally:
        d._ops.put(("stop",))
        d._thread.join(timeout=5)


def _delta(rid: str, text: str, ids: list[int], finished: bool = False):
    from vllm.outputs import CompletionOutput, RequestOutput

    comp = CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None)
    comp.finish_reason = "length" if finished else None
    return RequestOutput(rid, None, [1, 2, 3], None, [comp], finished, num_cached_tokens=2)


def _bare_driver():
    """An InprocDriver without its engine or stepping thread: only the stream hand-off."""
    from kvmesh.deployments.engine_driver import InprocDriver

    d = object.__new__(InprocDriver)
    d._streams, d._ops = {}, queue.SimpleQueue()
    return d


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
def test_deltas_the_consumer_has_not_taken_are_merged_into_one_output(kind):
    """Three steps' outputs waiting for a consumer that fell behind reach it as one delta holding all three
    (AsyncLLM's collector does the same); outputs of another kind are passed one by one."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(output_kind=getattr(RequestOutputKind, kind))

    async def go():
        d = _bare_driver()
        stream = d._outputs({"prompt_token_ids": [1, 2, 3]}, params, "r1")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the stream is registered and waits
        d._push_step([_delta("r1", "a", [5])])
        got = [await first]
        d._push_step([_delta("r1", "b", [6]), _delta("other", "x", [9])])  # "other": no stream, dropped
        d._push_step([_delta("r1", "c", [7])])
        d._push_step([_delta("r1", "d", [8], finished=True)])
        await asyncio.sleep(0)  # the consumer was busy: three steps arrived before it asked again
        got += [out async for out in stream]
        return got

    got = asyncio.run(go())
    texts = [o.outputs[0].text for o in got]
    if kind == "DELTA":
        assert texts == ["a", "bcd"] and list(got[1].outputs[0].token_ids) == [6, 7, 8]
        assert got[1].finished and got[1].outputs[0].finish_reason == "length"
    else:
        assert texts == ["a", "b", "c", "d"] and got[-1].finished


def test_an_error_behind_waiting_deltas_is_raised_after_they_are_delivered():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    async def go():
        d = _bare_driver()
        stream = d._outputs({"prompt_token_ids": [1]}, SamplingParams(output_kind=RequestOutputKind.DELTA), "r1")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        d._push_step([_delta("r1", "a", [5])])
        d._push_step([_delta("r1", "b", [6])])
        d._push("r1", RuntimeError("engine step failed"))
        await asyncio.sleep(0)
        out = await first
        with pytest.raises(RuntimeError, match="step failed"):
            await stream.__anext__()
        return out

    assert asyncio.run(go()).outputs[0].text == "ab"


def test_the_counts_name_their_requests_while_queued_and_running_and_none_once_ended():
    """Routers tell the requests they know of from work they do not by these names (`load_report.LoadReports`)."""

    async def go():
        load, gate, seen = _LoadCounter(), asyncio.Event(), []
        waiting = load.track(_engine(2, [], gate=gate), request_id="q1")
        first = asyncio.ensure_future(waiting.__anext__())
        await asyncio.sleep(0)
        seen.append((dict(load.queued_ids), dict(load.running_ids)))
        gate.set()
        await first
        seen.append((dict(load.queued_ids), dict(load.running_ids)))
        async for _ in waiting:
            pass
        seen.append((dict(load.queued_ids), dict(load.running_ids)))
        left = load.track(_engine(3, []), request_id="q2")
        await left.__anext__()
        await left.aclose()  # a client gone: its name goes with it
        seen.append((dict(load.queued_ids), dict(load.running_ids)))
        return seen

    assert asyncio.run(go()) == [({"q1": None}, {}), ({}, {"q1": None}), ({}, {}), ({}, {})]


# -- the step thread's failures, the step count and the load report --------------------------------------


class _FailingAbortEngine(_FakeLLMEngine):
    """An engine whose abort raises (its state is not what the driver expects): the thread's work outside
    `step()` can fail too. Each step waits a little so that the endless requests do not spin a core."""

    def abort_request(self, rids):
        raise KeyError(rids[0])

    def step(self):
        time.sleep(0.001)
        return super().step()


def _stop(d) -> None:
    d._ops.put(("stop",))
    d._thread.join(timeout=5)


def test_a_failure_outside_the_step_fails_every_stream_and_later_work_at_once():
    """A failing abort used to end the step thread silently: the stream in flight and every later request or
    call waited on a queue nobody read until Serve's health check replaced the replica."""
    from kvmesh.deployments.engine_driver import EngineBroken

    engine = _FailingAbortEngine(steps=10**9)
    d = _inproc(engine)

    async def go():
        a = d.generate({}, None, "a")
        await a.__anext__()
        b = d.generate({}, None, "b")
        await b.__anext__()
        await b.aclose()  # its abort raises on the step thread
        with pytest.raises(EngineBroken, match="engine thread failed"):
            async for _ in a:  # the outputs sent before the failure, then EngineBroken
                pass
        assert not d.healthy()
        with pytest.raises(EngineBroken):  # refused at once, never queued for the thread
            await d.generate({}, None, "c").__anext__()
        with pytest.raises(EngineBroken):
            await d.call(lambda engine: 1)
        assert "c" not in engine.left and d._streams == {}

    try:
        asyncio.run(asyncio.wait_for(go(), 10))  # a bound so a regression fails rather than hangs
    finally:
        _stop(d)


def test_a_stopped_step_thread_refuses_requests_and_calls_at_once():
    """Nothing reads the queue once the thread has ended: work queued there would wait forever."""
    from kvmesh.deployments.engine_driver import EngineBroken

    d = _inproc(_FakeLLMEngine(steps=1))
    _stop(d)

    async def go():
        with pytest.raises(EngineBroken):
            await d.call(lambda engine: 1)
        with pytest.raises(EngineBroken):
            await d.generate({}, None, "a").__anext__()

    asyncio.run(asyncio.wait_for(go(), 10))
    assert _state(d.load) == (0, 0, 0) and d._streams == {}


def test_an_injected_step_failure_comes_after_the_configured_steps():
    """`engine.fail_step_after: N` (the engine-heals test's fault): N steps run, the next one fails."""
    from kvmesh.deployments.engine_driver import EngineBroken

    d = _inproc(_FakeLLMEngine(steps=5))
    d._fail_after = 2

    async def go():
        seen = []
        with pytest.raises(EngineBroken, match="injected step failure after 2 steps"):
            async for out in d.generate({}, None, "a"):
                seen.append(out.finished)
        return seen

    try:
        assert asyncio.run(asyncio.wait_for(go(), 10)) == [False, False]
        assert d.steps == 2 and not d.healthy()
    finally:
        _stop(d)


class _CountedLookupEngine(_FakeLLMEngine):
    """A request whose connector lookup is answered after `stalls` steps that run nothing (no output,
    nothing running); each step records the driver's step count as a concurrent reader sees it then."""

    def __init__(self, stalls: int):
        super().__init__(steps=1)
        self.stalls, self.running, self.seen, self.driver = stalls, [], [], None

    def has_requests(self) -> bool:
        return bool(self.left)

    def step(self):
        self.seen.append(self.driver.steps)
        self.calls += 1
        if self.calls <= self.stalls:
            return []
        return super().step()


def test_the_step_count_counts_a_step_once_it_is_done_and_never_goes_back():
    """`steps` is exported as a counter: one that read N+1 during a stalled step and N after it (the step
    taken back) looked like a counter reset to Prometheus. A read during a step sees only finished steps."""
    engine = _CountedLookupEngine(stalls=3)
    d = _inproc(engine)
    engine.driver, d._sched = d, engine

    async def go():
        return [out.finished async for out in d.generate({}, None, "a")]

    try:
        assert asyncio.run(asyncio.wait_for(go(), 10)) == [True]
        assert engine.seen == [0, 0, 0, 0] and d.steps == 1  # three stalled steps, then the one that served
    finally:
        _stop(d)


def test_a_duplicate_request_id_is_refused_before_it_is_counted_and_is_not_the_clients_fault():
    """Both drivers' bookkeeping (`track`, and the in-process driver's own): the refused duplicate's end used
    to take the first request's name off the load report (running 1, running_ids []), and its ValueError
    reached the client as a 400. The first call still runs here (the ingress gave it up as lost), so the
    ingress should send the request again instead, without marking this healthy replica failed."""
    from kvmesh.deployments.migration import replica_failure

    async def refuse_second(first, second):
        await first.__anext__()
        with pytest.raises(Exception, match="already in flight") as refused:
            await second.__anext__()
        return refused.value

    def load_of(load):
        return load.queued, load.running, list(load.queued_ids), list(load.running_ids), load.aborted

    async def bare():  # AsyncDriver's path: only `track` keeps the books
        load = _LoadCounter()
        exc = await refuse_second(
            load.track(_engine(3, []), request_id="r"), load.track(_engine(3, []), request_id="r")
        )
        return exc, load_of(load)

    d = _inproc(_FakeLLMEngine(steps=4))

    async def inproc():
        first = d.generate({}, None, "r")
        exc = await refuse_second(first, d.generate({}, None, "r"))
        books = load_of(d.load)
        assert [out.finished async for out in first][-1]  # the first goes on to its end
        return exc, books

    try:
        for exc, books in (asyncio.run(asyncio.wait_for(bare(), 10)), asyncio.run(asyncio.wait_for(inproc(), 10))):
            assert books == (0, 1, [], ["r"], 0)  # the first is still counted and named
            assert not isinstance(exc, ValueError)  # the ingress answers ValueErrors as the client's 400
            assert replica_failure(exc) == (True, None)  # sent again, no replica named as failed
    finally:
        _stop(d)


def test_a_load_report_read_mid_transition_names_every_counted_request():
    """Serve reads `record_routing_stats` on a worker thread while the loop moves a request from queued to
    running: a report read between the two updates counted a running request without naming it."""
    from kvmesh.deployments.engine import EngineReplica

    load, reports = _LoadCounter(), []
    replica = object.__new__(EngineReplica)
    replica.driver = SimpleNamespace(
        load=load, steps=0, healthy=lambda: True, external_hit_tokens=0, kv_usage=lambda: 0.0
    )
    replica.replica_id, replica.stats_errors, replica.events_relay = "rep", 0, None
    replica.kv_events_endpoint = replica.replay_endpoint = None
    replica.node_id, replica.num_blocks, replica.tier_info = "n", 1, None
    replica.cfg = {"block_size": 16, "hash_algo": "sha256"}
    readers = []

    class _ReadMidway(dict):
        """Starts a report on another thread just as the request is being named running."""

        def __setitem__(self, key, value):
            reader = threading.Thread(target=lambda: reports.append(replica.record_routing_stats()))
            reader.start()
            readers.append(reader)
            reader.join(0.5)  # a report that waits for the transition to finish is the fix; it is not awaited
            super().__setitem__(key, value)

    load.running_ids = _ReadMidway()

    async def go():
        stream = load.track(_engine(2, []), request_id="q")
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(go())
    for reader in readers:
        reader.join(5)
    assert reports, "no report was read"
    for r in reports:
        assert (r["queued"], r["running"]) == (len(r["queued_ids"]), len(r["running_ids"])), r

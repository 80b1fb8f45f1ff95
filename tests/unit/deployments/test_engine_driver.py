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

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def add_request(self, rid, prompt, params):
        if prompt.get("bad"):
            raise ValueError("prompt too long")
        self.left[rid] = self.steps

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
        done = [out.finished async for out in d.generate({}, None, "a")]
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

    def add_request(self, rid, prompt, params):
        super().add_request(rid, prompt, params)
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
    engine = _FakeLLMEngine(steps=4)
    d = _inproc(engine)

    async def go():
        first = d.generate({}, None, "r")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
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

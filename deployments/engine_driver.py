"""Drive one vLLM engine from asyncio: `generate(prompt, params, request_id)` streams RequestOutputs.

Why two drivers: vLLM's `AsyncLLM` always runs its EngineCore in a child process (~25 s start and
~2.5 GB each on CPU), which is right on a GPU node but too heavy for a 2-core CI machine running two
replicas. `InprocDriver` steps the synchronous `LLMEngine` (in-process EngineCore when
VLLM_ENABLE_V1_MULTIPROCESSING=0: ~2 s start) in one dedicated thread and hands outputs to asyncio
queues; `AsyncDriver` simply wraps `AsyncLLM`. Both run the same scheduler, prefix cache, KV-event
publisher and KV connector, so routing and caching behave identically. Nothing here knows about Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

from kvmesh.cluster.thread_names import name_this_thread
from kvmesh.deployments.config import engine_dtype
from kvmesh.deployments.gloo_device import one_gloo_device
from kvmesh.deployments.replica_loss import ReplicaGone
from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient

log = logging.getLogger(__name__)


def build_engine_args(cfg: dict, model_path: str, kv_events: dict | None, kv_transfer: dict | None):
    """vLLM engine arguments from a validated engine config (deployments/config.py)."""
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        block_size=cfg["block_size"],
        max_model_len=cfg["max_model_len"],
        dtype=engine_dtype(cfg["model"], cfg["dtype"]),
        enforce_eager=cfg["enforce_eager"],
        enable_prefix_caching=True,
        prefix_caching_hash_algo=cfg["hash_algo"],
        seed=cfg["seed"],
        max_num_seqs=cfg["max_num_seqs"],
        stream_interval=cfg.get("stream_interval", 1),
        scheduling_policy=cfg.get("scheduling_policy", "fcfs"),
        disable_log_stats=False,
    )
    if cfg.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
    if cfg.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = cfg["gpu_memory_utilization"]
    if cfg.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = cfg["num_gpu_blocks_override"]
    if kv_events:
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **kv_events)
    if kv_transfer:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
    return AsyncEngineArgs(**kwargs)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """Resolve an engine-thread call's future on its loop (unless the caller has given it up)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class RequestInFlight(ReplicaGone):
    """A request under an id this replica is still serving: the ingress gave up an earlier call of it (its
    replica looked gone) that still runs here. Not the client's fault, and this replica is not broken: as
    a `ReplicaGone` the ingress sends the request again without blaming the replica (a 503 once its moves
    are spent), by which time the abandoned call has usually been cancelled."""


class _LoadCounter:
    """Queued = admitted but no token yet; running = producing tokens. Counted by the driver itself so
    both drivers report the same thing without reaching into engine internals.

    Updated on the replica's event loop but read by Serve on a worker thread (`record_routing_stats` is
    sync): every update and `report` take `_lock`, so a report never catches a request between its two
    states (counted in neither list, or counts that disagree with the names)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queued = 0
        self.running = 0
        self.aborted = 0  # requests given up before finishing (client went away)
        # the request ids behind the two counts: routers tell the requests they know of from work they do not,
        # and which of theirs have started (`EngineReplica.record_routing_stats`)
        self.queued_ids: dict[str, None] = {}
        self.running_ids: dict[str, None] = {}

    def report(self, max_ids: int) -> dict:
        """The counts and the ids behind them (None for a list longer than `max_ids`), taken together."""
        with self._lock:
            return {
                "queued": self.queued,
                "running": self.running,
                "queued_ids": list(self.queued_ids) if len(self.queued_ids) <= max_ids else None,
                "running_ids": list(self.running_ids) if len(self.running_ids) <= max_ids else None,
                "aborted": self.aborted,
            }

    async def track(
        self,
        outputs: AsyncGenerator[Any, None],
        on_abandon: Callable[[], None] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[Any]:
        """Pass one request's engine outputs through, keeping queued/running/aborted: the one wrapper
        both drivers' `generate` use. A stream left before its finished output (the caller closed it
        or was cancelled) counts as aborted and `on_abandon` tells the engine; one the engine failed
        (it raised) does not. The engine's stream is closed here, not left to the garbage collector.

        A request under an id still in flight here is refused (`RequestInFlight`) before it is counted:
        the report names each id once, and the second request's end would take the first's name off."""
        with self._lock:
            refused = request_id is not None and (request_id in self.queued_ids or request_id in self.running_ids)
            if not refused:
                self.queued += 1
                if request_id is not None:
                    self.queued_ids[request_id] = None
        if refused:
            await outputs.aclose()
            raise RequestInFlight(f"request {request_id!r} is already in flight on this replica")
        started = finished = False
        try:
            async for out in outputs:
                if not started:
                    started = True
                    with self._lock:
                        self.queued -= 1
                        self.running += 1
                        if request_id is not None:
                            self.queued_ids.pop(request_id, None)
                            self.running_ids[request_id] = None
                finished = out.finished
                yield out
        except Exception:
            finished = True  # the engine gave the request up itself: nothing to abort
            raise
        finally:
            with self._lock:
                if request_id is not None:
                    self.queued_ids.pop(request_id, None)
                    self.running_ids.pop(request_id, None)
                if started:
                    self.running -= 1
                else:
                    self.queued -= 1
                if not finished:
                    self.aborted += 1
            if not finished and on_abandon is not None:
                on_abandon()
            await outputs.aclose()


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


def _delta_kind():
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA


# The request an engine with a KV connector runs once, as soon as it is built: LMCache's connector starts
# its heartbeat with its engine's first step (its first event poll), and only a running heartbeat sees
# its server restart and registers the engine's KV caches with the new one. One token fills no block,
# so it stores nothing, publishes no KV event and leaves nothing in the prefix cache.
WARM_UP_REQUEST_ID = "kvmesh-connector-warm-up"
WARM_UP_PROMPT: dict[str, Any] = {"prompt_token_ids": [0]}

# How often an engine whose requests all wait on its KV connector polls it. Finished requests held for
# their stores are polled every DRAIN_POLL_S. Requests waiting for a lookup or a load are polled at once,
# then at waits doubling from STALL_FIRST_WAIT_S up to STALL_MAX_WAIT_S (vLLM's own engine loop sleeps
# 1 ms there): a lookup answers in milliseconds and a request's TTFT waits for the poll that sees it,
# while stepping without pause spins a core (and the GIL the connector's own threads need to receive
# the answer) for as long as the server takes, the whole message-queue timeout if it hangs.
DRAIN_POLL_S = 0.005
STALL_FIRST_WAIT_S = 0.0002
STALL_MAX_WAIT_S = 0.001


def warm_up_params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1)


def has_kv_connector(engine_args) -> bool:
    return getattr(engine_args, "kv_transfer_config", None) is not None


class EngineBroken(RuntimeError):
    """The engine can no longer serve (its step failed): the request should move to another replica."""


def connector_hits_logger(driver):
    """A vLLM stat logger factory that adds each step's KV-connector prefix hits (prompt tokens the engine
    loaded through LMCache rather than finding in its own cache) to `driver.external_hit_tokens`. Why:
    LMCache's own lookup counters count every token it holds, including those the engine already had, so
    they cannot say which hits came from the tiers; vLLM knows, per request, what it loaded."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _ConnectorHits(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            stats = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
            if stats is not None:
                driver.external_hit_tokens += int(stats.hits)

        def log_engine_initialized(self):
            pass

    return _ConnectorHits


class InprocDriver:
    """LLMEngine (in-process EngineCore) stepped by one thread; asyncio callers get per-request queues.
    Each step's outputs reach an event loop in one wake-up, and a stream's deltas that pile up while
    its consumer is busy are merged into one output (as AsyncLLM does), so a loaded replica forwards
    fewer, larger chunks instead of falling further behind.

    A failed `step()` leaves vLLM's scheduler in an unknown state, so the driver stops stepping for
    good: every stream and every later request fails with `EngineBroken`, and `healthy()` turns false
    so that Serve's health check replaces the replica (a live thread serving nothing would stay green).
    Anything else the thread does that raises (an abort, handing outputs over) ends the engine the same
    way: a thread that died silently would leave every stream and later request waiting on a queue
    nobody reads until the health check replaced the replica.
    """

    _broken: BaseException | None = None  # the failure that ended this engine
    _broken_why = ""  # what every stream and later request is told (EngineBroken's message)
    _closed = False  # the step thread has ended (stopped or failed): it reads no more ops
    external_hit_tokens = 0  # prompt tokens loaded through the KV connector (LMCache), summed over requests
    _fail_after: int | None = None  # test-only fault: step() raises once this many steps have run
    _steps = 0
    _sched: Any = None  # vLLM's scheduler, read only with a KV connector (see _ask_scheduler)

    def __init__(self, engine_args, fail_step_after: int | None = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.v1.engine.llm_engine import LLMEngine

        self._fail_after = fail_step_after
        patch_llvmlite_dunder_lookup()  # numba may be loaded here (kvstore/compat.py)
        with one_gloo_device():  # vLLM's dozen process groups, one TCP loop thread (deployments/gloo_device.py)
            self.engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[connector_hits_logger(self)])
        if has_kv_connector(engine_args):
            try:
                self._sched = self._scheduler()
            except Exception:
                log.exception("cannot read vLLM's scheduler: an idle engine frees a connector's stored blocks late")
            self._warm_up()
        self.load = _LoadCounter()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine-step", daemon=True)
        self._thread.start()

    def _warm_up(self) -> None:
        """Step the warm-up request to its end before the step thread starts (see WARM_UP_REQUEST_ID)."""
        self.engine.add_request(WARM_UP_REQUEST_ID, WARM_UP_PROMPT, warm_up_params())
        while self.engine.has_unfinished_requests():
            self.engine.step()

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        name_this_thread("kvmesh-step")
        stall_wait = 0.0  # how long to wait for an op before the next step while the connector is awaited
        try:
            while not self._stop:
                try:
                    stall_wait = self._turn(stall_wait)
                except Exception as exc:  # anything the thread does, not only the step: see the class doc
                    self._fail(exc, "engine thread failed")
                    stall_wait = 0.0
        except BaseException as exc:
            self._fail(exc, "engine thread ended")
            raise
        finally:
            self._closed = True  # before the last look at the queue: see _submit
            self._drain_ops()

    def _turn(self, stall_wait: float) -> float:
        """One turn of the step thread: apply the ops waiting, then step once; the next turn's stall wait."""
        live = self._broken is None and self.engine.has_unfinished_requests()
        draining = not live and self._broken is None and self._connector_pending()
        if live:
            op = self._next_op(block=stall_wait > 0, timeout=stall_wait or None)
        elif draining:  # only a KV connector's transfers left: poll them, without spinning a core
            op = self._next_op(block=True, timeout=DRAIN_POLL_S)
        else:
            op = self._ops.get()  # idle (or broken): sleep until a request (or stop) arrives
        while op is not None:
            self._apply(op)
            op = self._next_op(block=False)
        if self._stop:
            return 0.0
        live = self._broken is None and self.engine.has_unfinished_requests()
        if not (live or (self._broken is None and self._connector_pending())):
            return 0.0
        try:
            outputs = self._step(counted=live)
        except Exception as exc:
            self._fail(exc, "engine step failed")
            return 0.0
        stalled = live and not outputs and self._awaiting_connector()
        if live and not stalled:  # counted once done: a stalled step ran nothing, and the count never goes back
            self._steps += 1
        self._push_step(outputs)
        return min(STALL_MAX_WAIT_S, max(STALL_FIRST_WAIT_S, 2 * stall_wait)) if stalled else 0.0

    def _fail(self, exc: BaseException, what: str) -> None:
        """End the engine for good (called in an `except` block): every open stream gets `EngineBroken`,
        later requests and calls get it at once, and `healthy()` turns false."""
        if self._broken is not None:  # already broken: the thread only refuses work now
            log.exception("engine thread error after the engine broke")
            return
        log.exception("%s: this replica stops serving and fails its health check", what)
        self._broken_why = f"{what}: {exc!r}"
        self._broken = exc
        for rid in list(self._streams):
            try:
                self._push(rid, EngineBroken(self._broken_why))
            except Exception:  # its event loop is closed: nobody waits there
                pass

    def _refusal(self) -> EngineBroken:
        return EngineBroken(self._broken_why or "engine stopped")

    def _refuse(self, op) -> None:
        """Fail an op the engine will not run: its request or call gets `EngineBroken`."""
        if op[0] == "add":
            self._push(op[1], self._refusal())
        elif op[0] == "call":
            _, _, loop, fut = op
            loop.call_soon_threadsafe(_settle, fut, None, self._refusal())

    def _drain_ops(self) -> None:
        """Refuse every op still queued: nothing reads the queue once the thread has ended."""
        while (op := self._next_op(block=False)) is not None:
            try:
                self._refuse(op)
            except Exception:  # its event loop is closed: nobody waits there
                pass

    def _next_op(self, block: bool, timeout: float | None = None):
        try:
            return self._ops.get(block=block, timeout=timeout)
        except queue.Empty:
            return None

    def _connector_pending(self) -> bool:
        """Whether vLLM's scheduler still holds finished requests, as it does while a KV connector
        (LMCache) stores their blocks: only later steps collect the finished stores and free the blocks.
        vLLM's own engine loop keeps stepping for them; so does this one. False if the scheduler cannot
        be read (the engine then goes idle as before, and the next request's steps free the blocks)."""
        return self._ask_scheduler(lambda sched: sched.has_requests(), "finished requests; not waiting for them")

    def _awaiting_connector(self) -> bool:
        """Whether nothing is running while requests are unfinished: each waits on the KV connector (a
        lookup it has not answered, or a load between steps), so stepping again at once would compute
        nothing. False without a connector, or if the scheduler cannot be read."""
        return self._ask_scheduler(lambda sched: not sched.running, "running requests; stepping without pause")

    def _ask_scheduler(self, question: Callable[[Any], Any], failing: str) -> bool:
        """`question(vLLM's scheduler)`, or False without a KV connector. The scheduler is vLLM's internals:
        if reading it fails, this is logged once and every later question answers False."""
        if self._sched is None:
            return False
        try:
            return bool(question(self._sched))
        except Exception:
            log.exception("cannot ask vLLM's scheduler for %s", failing)
            self._sched = None
            return False

    def _step(self, counted: bool = True):
        """One engine step. `counted`: one that serves requests (`_turn` counts it once it is done); a step
        that only collects a connector's finished transfers serves none."""
        if self._fail_after is not None and self._steps + int(counted) > self._fail_after:
            raise RuntimeError(f"injected step failure after {self._fail_after} steps (engine.fail_step_after)")
        return self.engine.step()

    def _apply(self, op) -> None:
        kind = op[0]
        if self._broken is not None and kind in ("add", "call"):
            self._refuse(op)
        elif kind == "add":
            _, rid, prompt, params, priority = op
            try:
                self.engine.add_request(rid, prompt, params, priority=priority)
            except Exception as exc:  # bad request (e.g. too long): report to the caller only
                self._push(rid, exc)
        elif kind == "abort":
            if self._broken is None:  # a broken engine's requests have all been failed already
                self.engine.abort_request([op[1]])
        elif kind == "call":
            _, fn, loop, fut = op
            try:
                res = fn(self.engine)
                loop.call_soon_threadsafe(_settle, fut, res, None)
            except Exception as exc:
                # passed as an argument, not closed over: Python unbinds `exc` when the except block ends,
                # before the loop runs the callback
                loop.call_soon_threadsafe(_settle, fut, None, exc)
        elif kind == "stop":
            self._stop = True

    def _push(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _push_step(self, outputs) -> None:
        """Hand one step's outputs to their streams with one wake-up per event loop, not one per
        request: a step of a full batch has an output for every running request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    # -- asyncio side ----------------------------------------------------------------------------
    def generate(self, prompt: dict, params, request_id: str, priority: int = 0) -> AsyncIterator[Any]:
        """The request's outputs; `priority` orders it under the engine's priority scheduling (lower first)."""
        return self.load.track(
            self._outputs(prompt, params, request_id, priority),
            on_abandon=lambda: self._ops.put(("abort", request_id)),
            request_id=request_id,
        )

    async def _outputs(self, prompt: dict, params, request_id: str, priority: int = 0) -> AsyncGenerator[Any, None]:
        """The engine thread's outputs for one request, up to the finished one; an error it reports is raised."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if request_id in self._streams:  # outputs go by id: the second would take the first's, and its abort both
            raise RequestInFlight(f"request {request_id!r} is already in flight on this replica")
        self._streams[request_id] = (loop, q)
        try:
            self._submit(("add", request_id, prompt, params, priority))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        merge = getattr(params, "output_kind", None) == _delta_kind()
        held = None
        try:
            while True:
                if held is not None:  # an error found behind merged deltas, raised after them
                    item, held = held, None
                else:
                    item = await q.get()
                if isinstance(item, Exception):
                    raise item
                # deltas the consumer has not taken yet are merged into one output, as AsyncLLM's
                # per-request collector does: a consumer that falls behind (a busy replica) then
                # forwards one message per turn of its loop instead of one per engine step
                while merge and not item.finished and not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, Exception):
                        held = nxt
                        break
                    item.add(nxt, aggregate=True)
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)

    async def call(self, fn):
        """Run fn(engine) on the engine thread (engine objects are not thread-safe)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(("call", fn, loop, fut))
        return await fut

    def _serving(self) -> bool:
        """Whether the step thread still takes requests (not broken, not ended)."""
        return self._broken is None and not self._closed

    def _submit(self, op) -> None:
        """Queue `op` for the step thread; `EngineBroken` at once if the engine is broken or the thread has
        ended. A thread ending meanwhile sets `_closed` before its last look at the queue: if that look may
        have missed `op`, it is refused here."""
        if not self._serving():
            raise self._refusal()
        self._ops.put(op)
        if self._closed:
            self._drain_ops()

    def _scheduler(self) -> Scheduler:
        """vLLM's own scheduler, from its internals (raises if their shape changed)."""
        client = cast("InprocClient", self.engine.engine_core)  # in-process: __init__ turned multiprocessing off
        return cast("Scheduler", client.engine_core.scheduler)

    def kv_usage(self) -> float:
        """Read from vLLM's internals; raises if their shape changed (the replica counts and logs it)."""
        return float(self._scheduler().kv_cache_manager.usage)  # the scheduler has the KV manager

    def num_blocks(self) -> int:
        return int(self.engine.vllm_config.cache_config.num_gpu_blocks or 0)

    @property
    def steps(self) -> int:
        """Engine steps so far: requests served over steps is how much each step batched."""
        return self._steps

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call(lambda e: e.reset_prefix_cache()))

    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stop and self._broken is None

    def shutdown(self) -> None:
        self._ops.put(("stop",))
        self._thread.join(timeout=10)
        try:
            self.engine.engine_core.shutdown()
        except Exception:
            pass


class AsyncDriver:
    """vLLM's AsyncLLM (EngineCore in a child process): the production path on GPU nodes."""

    def __init__(self, engine_args) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        driver = self
        self._kv_usage = 0.0
        self._steps = 0
        self.external_hit_tokens = 0

        class _UsageLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:  # one per engine step
                    driver._kv_usage = float(scheduler_stats.kv_cache_usage)
                    driver._steps += 1

            def log_engine_initialized(self):
                pass

        loggers: list[Any] = [_UsageLogger, connector_hits_logger(self)]
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            # in a Ray worker: vLLM's own metrics leave through Ray's metrics port as ray_vllm_*
            # (the k8s/monitoring dashboard's vLLM panels); its default Prometheus registry is served by nobody here
            from kvmesh.deployments.vllm_ray_metrics import ray_stat_logger

            loggers.append(ray_stat_logger())
        patch_llvmlite_dunder_lookup()  # numba may be loaded here (kvstore/compat.py)
        self.engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers)
        self.load = _LoadCounter()
        # the warm-up request (see WARM_UP_REQUEST_ID) runs on the loop that builds the driver: a Serve
        # replica's constructor runs on its event loop, and AsyncLLM serves from the loop that calls it first
        self.warm_up: asyncio.Task | None = None
        if has_kv_connector(engine_args):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                log.warning(
                    "AsyncDriver built outside an event loop: its KV connector heartbeat starts with its first request"
                )
            else:
                self.warm_up = loop.create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            async for _ in self.engine.generate(WARM_UP_PROMPT, warm_up_params(), WARM_UP_REQUEST_ID):
                pass
        except Exception:  # the engine's own failure shows in its health check and its first request
            log.exception("the KV connector warm-up request failed")

    def generate(self, prompt: dict, params, request_id: str, priority: int = 0) -> AsyncIterator[Any]:
        # AsyncLLM aborts the request itself when its generator is closed (track closes it)
        outputs = self.engine.generate(prompt, params, request_id, priority=priority)
        return self.load.track(outputs, request_id=request_id)

    def kv_usage(self) -> float:
        return self._kv_usage

    @property
    def steps(self) -> int:
        """Engine iterations so far (one stats record per EngineCore step)."""
        return self._steps

    def num_blocks(self) -> int:
        return int(self.engine.vllm_config.cache_config.num_gpu_blocks or 0)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine.reset_prefix_cache())

    def healthy(self) -> bool:
        return not self.engine.errored

    def shutdown(self) -> None:
        self.engine.shutdown()


def make_driver(mode: str | None, engine_args, fail_step_after: int | None = None):
    """`fail_step_after` (test-only fault, in-process engines only): step() raises after that many steps."""
    if mode is None:
        mode = "inproc" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" else "async"
    return InprocDriver(engine_args, fail_step_after) if mode == "inproc" else AsyncDriver(engine_args)

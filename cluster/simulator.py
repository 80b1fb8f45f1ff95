"""Trace simulator: replay a Mooncake-form trace through N simulated replicas under one placement policy.

Model (docs/simulator.md has the long form):
- Each replica is one accelerator with a finite HBM block cache (`BlockLRU`, LRU, parents outlive
  children); optionally a host tier per node (LMCache L1, write-through: every computed or loaded
  block is stored there) and one shared tier for the fleet (LMCache L2, write-through). A block reaches
  the tiers when the request computing it is routed, or with `tier_store_at="computed"` when its prefill
  ends (`SimConfig.tier_store_at`).
- The simulated caches report every store and eviction to a real `kvmesh.cluster.index.PrefixIndex`, the
  same index the live router feeds from KV events; policies see `ReplicaView`s built from its
  `match` plus the replica's load, exactly like the live router.
- Requests arrive at trace timestamps (optionally scaled to a target load, see `kvmesh.cluster.trace
  .scale_to_load`). A replica prefills one request at a time, FIFO (`CostModel.prefill_s`: base +
  uncached tokens x prefill cost + tier tokens x load cost); a request needs one of `max_batch`
  sequence slots from the start of its prefill to the end of its decode (output_length x
  decode_s_per_token). TTFT = end of prefill - arrival.
- Because each replica's prefill queue is FIFO, a request's cache hits can be decided when it is
  routed: everything routed earlier to that replica is prefilled before it starts. Tier copies
  become visible when the computing request is routed, early by as much as that request's TTFT (its wait
  in its replica's queue plus its prefill: no bound short of the queue's length), or when its prefill ends
  (`tier_store_at="computed"`).
- With stores at prefill end and a shared tier, a request whose prefix is still being computed elsewhere
  can be held until it is stored (`Policy.hold_worth`): it then starts on the replica chosen at arrival
  no earlier than the store, and loads that prefix. A prefix stored before the request's own prefill
  starts loads without holding, as vLLM looks a waiting request up when it schedules it. Its replica runs
  what is sent to it meanwhile in the idle gap (`fit_in_gap`), out of FIFO order, so such a request is
  credited only hbm blocks computed before it starts, takes a sequence slot free throughout its span, and
  evicts nothing from the replica's cache (else it waits its turn).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.cluster.block_cache import BlockLRU
from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.stats import nearest_rank
from kvmesh.cluster.trace import Trace, offered_work_s, scale_to_load
from kvmesh.policies.base import FleetView, Policy, ReplicaView, RequestInfo
from kvmesh.policies.cost_model import DEFAULT_COST_MODEL, CostModel, cacheable_blocks, cached_tokens


@dataclass
class SimConfig:
    replicas: int
    capacity_blocks: int
    host_blocks: int = 0  # per node; 0 = no host tier
    shared: bool = False
    shared_blocks: int | None = None  # None = unbounded shared tier
    replicas_per_node: int = 1
    load: float | None = None  # None = trace timestamps as they are
    cost: CostModel = field(default_factory=lambda: DEFAULT_COST_MODEL)
    # when a computed block becomes loadable from the host and shared tiers: "routed" (when the request
    # computing it is placed: early by as much as that request's TTFT, queueing included) or "computed" (when
    # its prefill ends, as LMCache stores it; a request arriving meanwhile on another replica computes it too)
    tier_store_at: str = "routed"
    # LMCache chunk / engine block: the host and shared tiers store whole chunks, and a prefix loads from them
    # in whole chunks (a chunk is keyed by every token up to its end), as the live router counts them
    tier_chunk_blocks: int = 1
    uncached_rate: float = 3.00  # $ per 1M uncached prompt tokens
    cached_rate: float = 0.30  # $ per 1M cached prompt tokens
    seed: int = 0

    def check(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        if self.host_blocks < 0:
            raise ValueError("host_blocks must be >= 0")
        if self.replicas_per_node < 1:
            raise ValueError("replicas_per_node must be >= 1")
        if self.shared_blocks is not None and self.shared_blocks < 1:
            raise ValueError("shared_blocks must be >= 1")
        if self.load is not None and not (self.load > 0 and math.isfinite(self.load)):
            raise ValueError("load must be a positive number")
        if not all(r >= 0 and math.isfinite(r) for r in (self.uncached_rate, self.cached_rate)):
            raise ValueError("cost rates must be finite numbers >= 0")  # NaN passed `< 0`: a NaN cost
        if self.tier_store_at not in ("routed", "computed"):
            raise ValueError("tier_store_at must be 'routed' or 'computed'")
        if self.tier_chunk_blocks < 1:
            raise ValueError("tier_chunk_blocks must be >= 1")


@dataclass
class ClosedLoop:
    """A client that keeps `concurrency` requests in flight, a user's next request only after its
    previous reply ended; requests that are ready wait for a free slot first come, first served (ties
    in trace order). That is how the replay client (and a chat front end) sends, so the simulator sees
    the live run's send order and overlap.

    With `arrivals` (s, one per request) a request is also not ready before its arrival: timed traffic
    whose users still wait for their replies. Why: a chat turn's prompt holds the previous turn's answer,
    so no user can send it before that answer has ended; timestamps scaled to a load can put it earlier
    (a conversation's turns 20 ms apart while each prefill takes longer), and a replay that sends it
    then makes every turn wait for, or recompute, a prefix nobody could have asked for yet.

    With `jitter_s`, each request is sent a further uniform draw in [0, jitter_s) after it is ready (seeded
    by `seed`). Why: live, requests ready together (an all-at-once start, replies ending in the same decode
    step) reach the router in an order the network and the event loops set, not the trace's, and which
    of two near-equal replicas a request gets can turn on it; runs with a few milliseconds of jitter show the
    spread of placements that timing alone produces (`robust_live.simulated_spread`)."""

    concurrency: int
    users: list | None = None  # per request: the user it belongs to (None: independent)
    arrivals: list[float] | None = None  # per request: the earliest it is sent (None: at once)
    jitter_s: float = 0.0
    seed: int = 0

    def sender(self, n: int) -> _ClosedLoopSender:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.users is not None and len(self.users) != n:
            raise ValueError("users must name one user (or None) per request")
        if self.arrivals is not None and len(self.arrivals) != n:
            raise ValueError("arrivals must give one time per request")
        if not (self.jitter_s >= 0 and math.isfinite(self.jitter_s)):
            raise ValueError("jitter_s must be a finite number >= 0")
        delays = None
        if self.jitter_s > 0:
            rng = random.Random(self.seed)
            delays = [rng.uniform(0.0, self.jitter_s) for _ in range(n)]
        return _ClosedLoopSender(self.concurrency, self.users or [None] * n, self.arrivals or [0.0] * n, delays)

    @classmethod
    def timed(cls, arrivals: list[float], users: list | None) -> ClosedLoop:
        """Open-loop timed traffic (no concurrency cap) in which a user's next request waits for its
        previous reply."""
        return cls(max(len(arrivals), 1), users, list(arrivals))

    @classmethod
    def replying(cls, trace: Trace, cfg: SimConfig) -> ClosedLoop | None:
        """`timed` at `cfg`'s arrivals for a trace whose requests name users (`trace.meta["users"]`); None
        for one that names none: its requests go at their times, with no reply to wait for."""
        users = trace.meta.get("users")
        return cls.timed(arrivals_for(trace, cfg)[0], users) if users else None


class _ClosedLoopSender:
    """Yields (request index, send time) in send order; told each request's end through `ended`."""

    def __init__(self, concurrency: int, users: list, arrivals: list[float], delays: list[float] | None = None):
        self.concurrency = concurrency
        self.ready: list[tuple[float, int]] = []  # (ready since, index): requests waiting for a slot
        self.after: dict[int, int] = {}  # index -> the same user's next request
        self.in_flight: list[float] = []  # stream ends of the requests in flight
        self.arrivals = arrivals
        self.delays = delays  # per request: sent this long after it is ready (None: at once)
        last: dict = {}
        for i, user in enumerate(users):
            if user is not None and user in last:
                self.after[last[user]] = i
            else:
                self.ready.append((arrivals[i] + delays[i] if delays else arrivals[i], i))
            if user is not None:
                last[user] = i
        heapq.heapify(self.ready)
        self.clock = 0.0

    def __iter__(self):
        while self.ready:
            since, i = heapq.heappop(self.ready)
            free = heapq.heappop(self.in_flight) if len(self.in_flight) >= self.concurrency else 0.0
            self.clock = max(self.clock, since, free)
            yield i, self.clock

    def ended(self, i: int, end: float) -> None:
        heapq.heappush(self.in_flight, end)
        nxt = self.after.get(i)
        if nxt is not None:
            arrival = self.arrivals[nxt]
            ready = end if end > arrival else arrival
            heapq.heappush(self.ready, (ready + self.delays[nxt] if self.delays else ready, nxt))


def reads(policy: Policy, signals: tuple[str, ...]) -> bool:
    """Whether `policy` names any of `signals` in its `load_signals` (the `FleetView.extra` entries it reads).
    Why ask: keeping them costs every request some work, which the policies that never read them are spared."""
    return any(name in getattr(policy, "load_signals", ()) for name in signals)


class EngineLoad:
    """Per replica, the load a vLLM engine reports about itself, which peers' routers read from its metrics:
    requests waiting to be scheduled (`vllm:num_requests_waiting`: from arrival until the prefill starts) and
    the fraction of KV blocks allocated (`vllm:kv_cache_usage_perc`: a request's blocks from the start of its
    prefill to the end of its decode). Why beside `queued` and `kv_usage`: those count a request from the
    moment it is routed (the router's own view, which kvmesh's policy reads). Policies get them as
    `FleetView.extra["waiting"]` and `extra["kv_cache_usage"]`. Approximations: a request's output blocks
    are allocated with its prompt's, and a prompt block two running requests share counts twice."""

    SIGNALS = ("waiting", "kv_cache_usage")

    def __init__(self, replicas: int):
        self.waiting = np.zeros(replicas, dtype=np.int64)
        self.kv_cache_usage = np.zeros(replicas)
        self.extra = {"waiting": self.waiting, "kv_cache_usage": self.kv_cache_usage}
        self._waiting = [0] * replicas  # Python copies: numpy scalar arithmetic costs several times a list's
        self._blocks = [0] * replicas
        self._usage = [0.0] * replicas

    def wait(self, k: int) -> None:
        """A request reached replica `k` and waits for its prefill."""
        self.waiting[k] = self._waiting[k] = self._waiting[k] + 1

    def start(self, k: int, blocks: int, inv_capacity: float, waited: bool = True) -> None:
        """A request's prefill starts on replica `k`: its `blocks` are allocated."""
        if waited:
            self.waiting[k] = self._waiting[k] = self._waiting[k] - 1
        self._allocate(k, blocks, inv_capacity)

    def free(self, k: int, blocks: int, inv_capacity: float) -> None:
        """A request's decode ended on replica `k`: its `blocks` are freed."""
        self._allocate(k, -blocks, inv_capacity)

    def view(self, k: int) -> dict:
        """Replica `k`'s figures, as `FleetView.view(k).extra` holds them."""
        return {"waiting": self._waiting[k], "kv_cache_usage": self._usage[k]}

    def _allocate(self, k: int, blocks: int, inv_capacity: float) -> None:
        b = self._blocks[k] = self._blocks[k] + blocks
        self.kv_cache_usage[k] = self._usage[k] = min(b * inv_capacity, 1.0)


class ActivePromptBlocks:
    """Per replica, the prompt blocks of the requests routed there and not finished, each block once however
    many of them hold it (block hash -> how many): the active blocks NVIDIA Dynamo's KV router books when it
    routes a request and frees when the request ends (ai-dynamo/dynamo `KvRouterConfig::default`:
    router_track_active_blocks and router_assume_kv_reuse true, router_track_output_blocks false, so output
    blocks are not booked). Policies get each replica's as `FleetView.extra["active_prompt_blocks"]`."""

    SIGNALS = ("active_prompt_blocks",)

    def __init__(self, replicas: int):
        self.blocks: list[dict] = [{} for _ in range(replicas)]
        column = np.empty(replicas, dtype=object)
        column[:] = self.blocks
        self.extra = {"active_prompt_blocks": column}
        self._ends: list[tuple[float, int, int, Any]] = []  # (end, request, replica, its blocks)

    def add(self, k: int, hashes, end: float, request: int) -> None:
        """Book a request's full prompt blocks on replica `k` until `end`."""
        held = self.blocks[k]
        for h in hashes:
            held[h] = held.get(h, 0) + 1
        heapq.heappush(self._ends, (end, request, k, hashes))

    def finish(self, now: float) -> None:
        """Free the blocks of every request that has ended by `now`."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            _, _, k, hashes = heapq.heappop(ends)
            held = self.blocks[k]
            for h in hashes:
                left = held[h] - 1
                if left:
                    held[h] = left
                else:
                    del held[h]

    def view(self, k: int) -> dict:
        """Replica `k`'s blocks, as `FleetView.view(k).extra` holds them."""
        return {"active_prompt_blocks": self.blocks[k]}


def fit_in_gap(
    gaps: list[tuple[float, float]],
    earliest: float,
    service: float,
    now: float,
    running: list[tuple[float, float]],
    max_batch: int,
    decode_s: float = 0.0,
) -> float | None:
    """The start of a prefill of `service` s, no earlier than `earliest`, inside one of a replica's idle
    `gaps` (start, end) that it fits whole, holding one of the replica's `max_batch` sequence slots from then
    to the end of its decode (`decode_s` after the prefill) beside the replica's other requests (`running`:
    (end, start) each, every request placed there that ends after `now`); None when none fits. Takes the
    span used out of its gap and drops gaps over by `now`. In a gap it starts as soon as it may and a slot
    is free: at the gap's start or `earliest`, or when one of the others ends.

    Why whole: a prefill that would run past the gap's end would, on the engine, delay the held request
    behind it; the simulator has already timed that request, so such a prefill waits its turn instead.
    Why every point of its span: requests starting later (the held one, those queued behind it) took
    their slots without counting this one."""
    gaps[:] = [g for g in gaps if g[1] > now]
    for k, (a, b) in enumerate(gaps):
        start = a if a > earliest else earliest
        if start + service > b:
            continue
        tries = [start] + sorted({e for e, _ in running if start < e and e + service <= b})
        for x in tries:
            if slots_free(running, x, x + service + decode_s, max_batch):
                gaps[k : k + 1] = [g for g in ((a, x), (x + service, b)) if g[1] > g[0]]
                return x
    return None


def slots_free(running: list[tuple[float, float]], start: float, end: float, max_batch: int) -> bool:
    """Whether fewer than `max_batch` of the spans in `running` ((end, start) each, half open) overlap
    any point of [`start`, `end`): one more sequence fits beside them throughout."""
    now = 0
    changes = []
    for e, s in running:
        if e <= start or s >= end:
            continue
        if s <= start:
            now += 1
        else:
            changes.append((s, 1))
        if e < end:
            changes.append((e, -1))
    if now >= max_batch:
        return False
    changes.sort()  # a slot freed at a moment is free for a start at that moment: -1 sorts first
    for _, d in changes:
        now += d
        if now >= max_batch:
            return False
    return True


def fits_without_eviction(lru: BlockLRU, blocks) -> bool:
    """Whether admitting `blocks` to `lru` evicts nothing."""
    cap = lru.capacity
    return cap is None or len(lru) + sum(1 for h in blocks if h not in lru) <= cap


def arrivals_for(trace: Trace, cfg: SimConfig) -> tuple[list[float], float | None]:
    """Arrival times in seconds from the trace start, and the offered load (None for a zero-length span)."""
    c = cfg.cost
    if cfg.load is not None:
        arr, _ = scale_to_load(
            trace, cfg.replicas, cfg.load, c.prefill_s_per_token, c.prefill_base_s, c.attention_s_per_token_pair
        )
        return arr, cfg.load
    t0 = trace.requests[0].timestamp_ms
    arr = [(r.timestamp_ms - t0) / 1000.0 for r in trace.requests]
    work = offered_work_s(trace.requests, c.prefill_s_per_token, c.prefill_base_s, c.attention_s_per_token_pair)
    span = arr[-1]
    return arr, (work / (cfg.replicas * span) if span > 0 else None)  # None: no time span, no rate


def send_plan(
    trace: Trace, cfg: SimConfig, arrivals: list[float] | None, client: ClosedLoop | None
) -> tuple[_ClosedLoopSender | None, list[float]]:
    """When requests are sent: by the closed-loop `client` (its sender; arrivals filled in as it sends), else
    at `arrivals` (the trace's own, scaled by `cfg`, when None)."""
    sender = client.sender(len(trace.requests)) if client is not None else None
    if sender is not None:
        return sender, [0.0] * len(trace.requests)
    if arrivals is None:
        arrivals, _ = arrivals_for(trace, cfg)
    return None, arrivals


def fleet_layout(cfg: SimConfig) -> tuple[list[str], list[str], int]:
    """The simulated fleet's replica ids, each one's node, and a prefix-index size with room for every block
    any tier of the fleet can hold (an unbounded shared tier counted as 10M)."""
    rids = [f"r{i}" for i in range(cfg.replicas)]
    nodes = [f"node{i // cfg.replicas_per_node}" for i in range(cfg.replicas)]
    unbounded_shared = 10_000_000 if cfg.shared and cfg.shared_blocks is None else 0
    tiers = len(set(nodes)) * cfg.host_blocks + (cfg.shared_blocks or 0) + unbounded_shared
    return rids, nodes, cfg.replicas * cfg.capacity_blocks + tiers + 1_000_000


def fleet_caches(cfg: SimConfig, nodes: list[str]) -> tuple[list[BlockLRU], dict[str, BlockLRU], BlockLRU | None]:
    """What the fleet really holds: each replica's own cache, each node's host tier (none without host
    blocks), the shared tier (None without one)."""
    hbm = [BlockLRU(cfg.capacity_blocks) for _ in range(cfg.replicas)]
    host = {nd: BlockLRU(cfg.host_blocks) for nd in set(nodes)} if cfg.host_blocks else {}
    return hbm, host, BlockLRU(cfg.shared_blocks) if cfg.shared else None


def simulate_policy(
    trace: Trace,
    cfg: SimConfig,
    policy: Policy,
    arrivals: list[float] | None = None,
    progress=None,
    client: ClosedLoop | None = None,
) -> dict:
    """Replay `trace` under `policy`; returns the per-policy metrics dict. With `client`, a closed-loop
    client (`ClosedLoop`) decides when, and so in which order, requests are sent, instead of `arrivals`."""
    cfg.check()
    sender, arrivals = send_plan(trace, cfg, arrivals, client)
    c = cfg.cost
    bs = trace.block_size
    N = cfg.replicas
    rids, nodes, index_blocks = fleet_layout(cfg)
    index = PrefixIndex(max_blocks=index_blocks, speculative_ttl_s=0.0)
    for rid, node in zip(rids, nodes):
        index.add_replica(rid, node)
    hbm, host, shared = fleet_caches(cfg, nodes)
    for rid in rids:  # the same lifecycle as the live router: replicas join, then requests are placed
        policy.on_replica_added(rid)
    if [index.slot_of(r) for r in rids] != list(range(N)):
        raise RuntimeError("prefix index did not give replicas slots 0..N-1")

    # load state, per replica, updated by a heap of (time, kind, replica, value) events:
    # kind 0 = prefill done (queued -> running), kind 1 = decode done (running -> gone), kind 2 = prefill starts
    # (waiting -> prefilling: the request's KV blocks are allocated)
    # Each is kept twice: as Python numbers (what the loop reads and updates) and as the numpy arrays the
    # policy reads (written from them), since numpy scalar arithmetic costs several times a list's.
    queued = np.zeros(N, dtype=np.int64)
    running = np.zeros(N, dtype=np.int64)
    pending = np.zeros(N, dtype=np.int64)  # uncached prompt tokens not yet prefilled
    kv_usage = np.zeros(N)  # min(active / capacity, 1), kept up to date as active changes
    queued_l = [0] * N
    running_l = [0] * N
    pending_l = [0] * N
    active_l = [0] * N  # KV blocks of unfinished requests
    kv_l = [0.0] * N
    # the load signals a peer's policy reads beside the router's own counts (None where the policy reads none):
    # what the engine reports (requests waiting, KV blocks allocated), what Dynamo's router books per request
    engine = EngineLoad(N) if reads(policy, EngineLoad.SIGNALS) else None
    booked = ActivePromptBlocks(N) if reads(policy, ActivePromptBlocks.SIGNALS) else None
    events: list[tuple[float, int, int, int]] = []
    unset = np.zeros(N, dtype=np.int64)  # hbm/host/shared blocks: set per request below
    tierless = not host and shared is None
    capacity = cfg.capacity_blocks
    fleet = FleetView(
        rids,
        unset,
        unset,
        unset,
        queued,
        running,
        kv_usage,
        pending,
        np.full(N, capacity, dtype=np.int64),
        {**(engine.extra if engine else {}), **(booked.extra if booked else {})},
    )
    server_free = [0.0] * N
    # per replica, the spans (start, end) it idles before a held request's prefill: the engine runs what is
    # sent to it meanwhile (the held request reaches it only when its hold ends)
    idle: list[list[tuple[float, float]]] = [[] for _ in range(N)]
    # ends of admitted requests, for the max_batch constraint
    slot_heap: list[list[float]] = [[] for _ in range(N)]
    max_batch = c.max_batch
    tpot = c.decode_s_per_token
    base_s = c.prefill_base_s
    per_token_s = c.prefill_s_per_token
    inv_cap = 1.0 / capacity
    # 0 tier tokens x a finite load cost is 0.0 (an infinite one would make it NaN, as prefill_s does)
    plain_service = (
        tierless
        and math.isfinite(c.host_load_s_per_token)
        and math.isfinite(c.shared_load_s_per_token)
        and not c.attention_s_per_token_pair
    )
    push, pop = heapq.heappush, heapq.heappop
    best, on_routed = policy.best, policy.on_routed
    requests = trace.requests
    match_hbm = index.match_hbm_array
    lrus = [lru.admit for lru in hbm]

    # metrics
    prompt_r = [0] * N
    hit_r = [0] * N
    computed_r = [0] * N
    reqs_r = [0] * N
    busy_r = [0.0] * N
    hbm_tokens = host_tokens = shared_tokens = 0
    ttfts: list[float] = []
    frac_sum = 0.0
    out_tokens = 0
    last_end = 0.0
    t_wall = time.perf_counter()

    def extra_view(j: int) -> dict:
        """Replica `j`'s `extra`, as `fleet.view(j)` holds it (from the Python copies)."""
        return {**(engine.view(j) if engine else {}), **(booked.view(j) if booked else {})}

    def store_in_tiers(j: int, keep) -> None:
        """Write-through of one request's full blocks into its node's host tier and the shared tier."""
        if host:
            new, evicted = host[nodes[j]].admit(keep)
            if evicted:
                index.remove_host(nodes[j], evicted)
            if new:
                index.store_host(nodes[j], new)
        if shared is not None:
            new, evicted = shared.admit(keep)
            if evicted:
                index.remove_shared(evicted)
            if new:
                index.store_shared(new)

    store_when_computed = cfg.tier_store_at == "computed" and not tierless
    chunk = cfg.tier_chunk_blocks
    tier_writes: list[tuple[float, int, int, list]] = []  # (prefill end, request, replica, blocks)
    pending_store: dict = {}  # block -> when its earliest pending tier write lands (shared tier only)

    # with a bounded shared tier a write keeps at most its first `shared_blocks` blocks: its own admit evicts the
    # rest (children first), so only those are worth waiting for
    kept_by_shared = cfg.shared_blocks

    def mark_pending(blocks, done: float) -> None:
        """`blocks` reach the shared tier at `done` (a prefill in flight: others may wait for it), those the
        tier keeps of them."""
        if kept_by_shared is not None and len(blocks) > kept_by_shared:
            blocks = blocks[:kept_by_shared]
        for h in blocks:
            if pending_store.get(h, math.inf) > done:
                pending_store[h] = done

    # Idle gaps (a request held for the shared tier idles its replica until then) run requests routed after
    # the ones queued behind the held one, so the FIFO argument for deciding hits at routing does not cover
    # them. Per replica, when each block it holds was computed there (its earliest prefill end), and each
    # request's slot span (end, start, a heap by end): a request runs in a gap only from when every block it
    # is credited from hbm has been computed, only with a slot free throughout its span, and only when its
    # blocks fit the cache without evicting any (an eviction then would take, in routing order, blocks of the
    # requests queued behind the gap, which on the engine run after it).
    gaps_possible = store_when_computed and shared is not None
    computed_at: list[dict] = [{} for _ in range(N)]
    spans: list[list[tuple[float, float]]] = [[] for _ in range(N)]

    holds = 0  # requests held for a prefix being computed elsewhere
    # a held request is announced when its hold ends, as the live router announces it when it sends it: its
    # blocks enter its replica's index entry only then (others may wait for its own prefill at once, as the
    # router lets them): (hold end, request, replica, blocks new in its cache)
    held: list[tuple[float, int, int, list]] = []
    order = sender if sender is not None else enumerate(arrivals)
    for i, t in order:
        r = requests[i]
        arrivals[i] = t
        ids = r.hash_ids
        n = r.input_length
        out_len = r.output_length
        while events and events[0][0] <= t:
            _, kind, k, val = pop(events)
            if kind == 0:
                queued[k] = queued_l[k] = queued_l[k] - 1
                running[k] = running_l[k] = running_l[k] + 1
                pending[k] = pending_l[k] = pending_l[k] - val
            elif kind == 1:
                running[k] = running_l[k] = running_l[k] - 1
                a = active_l[k] = active_l[k] - val
                kv_usage[k] = kv_l[k] = min(a * inv_cap, 1.0)
                if engine:
                    engine.free(k, val, inv_cap)
            elif engine:  # kind 2: pushed only with an engine
                engine.start(k, val, inv_cap)
        if booked:
            booked.finish(t)
        while tier_writes and tier_writes[0][0] <= t:
            done_at, _, k, blocks = pop(tier_writes)
            store_in_tiers(k, blocks)
            for h in blocks:
                if pending_store.get(h) == done_at:
                    del pending_store[h]
        while held and held[0][0] <= t:
            _, _, k, new = pop(held)
            cached = [h for h in new if h in hbm[k]]  # not evicted meanwhile
            if cached:
                index.store(rids[k], cached)
        if tierless:  # no host or shared tier: the three rows are equal; one array tells the policy so
            m0 = match_hbm(ids, N)  # column = slot = replica number
            fleet.hbm_blocks = fleet.host_blocks = fleet.shared_blocks = m0
        else:
            m = index.match_arrays(ids, N)  # rows hbm/host/shared, column = slot = replica number
            if chunk > 1:
                chunk_rows(m, chunk)
            fleet.hbm_blocks, fleet.host_blocks, fleet.shared_blocks = m[0], m[1], m[2]
        # the router hashes full blocks only: a policy sees what it would see live
        req = RequestInfo(ids[: n // bs], n, bs, out_len, r.tenant, str(i))
        fleet.inflight_blocks = None
        if pending_store and not tierless:
            fleet.inflight_blocks, ready = inflight_prefix(ids, m[2], pending_store, chunk)
            fleet.inflight_ready_s = ready - t
        j = best(req, fleet)
        if j is None:
            raise RuntimeError(f"{policy.name} placed request {i} nowhere")
        rid = rids[j]
        if tierless:
            hbm_b = host_b = shared_b = int(m0[j])
        else:
            hbm_b, host_b, shared_b = int(m[0, j]), int(m[1, j]), int(m[2, j])
        ready_at = held_until = 0.0
        # its prefix in flight may run past what any replica's index shows (a held request's own blocks)
        inflight = pending_store and not tierless
        top, stored_at = pending_prefix(ids, shared_b, len(ids), pending_store, chunk) if inflight else (0, 0.0)
        missing = cached_tokens(top, n, bs) - cached_tokens(shared_b, n, bs) if top > shared_b else 0
        if missing > 0:
            # a longer prefix of it is on another replica, being computed: loadable from the shared tier once
            # stored (worth waiting for, or stored by the time its own prefill would start here anyway)
            start = t if t > server_free[j] else server_free[j]
            if stored_at <= start or policy.hold_worth(missing, stored_at - start):
                shared_b = top
                ready_at = stored_at
                if stored_at > start:
                    holds += 1
                    held_until = stored_at
        # the replica as the policy saw it (`FleetView.view(j)`, from the Python copies)
        on_routed(
            req,
            rid,
            ReplicaView(
                rid, hbm_b, host_b, shared_b, queued_l[j], running_l[j], kv_l[j], pending_l[j], capacity, extra_view(j)
            ),
        )

        hbm_t = cached_tokens(hbm_b, n, bs)
        host_t = hbm_t if tierless else cached_tokens(host_b, n, bs)
        shared_t = hbm_t if tierless else cached_tokens(shared_b, n, bs)
        uncached = n - shared_t
        # caches: the request's full blocks end up in this replica's hbm and, write-through, in the tiers
        keep = ids[: cacheable_blocks(n, len(ids), bs)]
        gap_from = math.inf  # the earliest it may start in an idle gap (inf: it waits its turn)
        if idle[j] and fits_without_eviction(hbm[j], keep):
            gap_from = t if t > ready_at else ready_at
            when = computed_at[j]
            for h in ids[: hbm_t // bs]:
                w = when.get(h, math.inf)
                if w > gap_from:
                    gap_from = w
        new, evicted = lrus[j](keep)
        if evicted:
            index.remove(rid, evicted)
            if gaps_possible:
                when = computed_at[j]
                for h in evicted:
                    when.pop(h, None)
        if new and not held_until:
            index.store(rid, new)
        tier_keep = keep[: len(keep) // chunk * chunk] if chunk > 1 else keep
        if not tierless and not store_when_computed:
            store_in_tiers(j, tier_keep)
        # time (without tiers or attention term `CostModel.prefill_s`'s load and attention terms are 0.0, and
        # adding 0.0 changes no bit)
        service = base_s + uncached * per_token_s if plain_service else c.prefill_s(n, hbm_t, host_t, shared_t)
        sh = slot_heap[j]
        early = fit_in_gap(idle[j], gap_from, service, t, spans[j], max_batch, out_len * tpot) if idle[j] else None
        if early is not None:  # runs while a held request waits, as the engine runs what it has
            s = early
        else:
            s = t if t > server_free[j] else server_free[j]
            if ready_at > s:  # held until its prefix is stored: the replica idles meanwhile unless sent more
                idle[j].append((s, ready_at))
                s = ready_at
            while sh and sh[0] <= s:
                pop(sh)
            if len(sh) >= max_batch:
                e = pop(sh)
                s = e if e > s else s
            server_free[j] = s + service
        done = s + service
        if store_when_computed:
            push(tier_writes, (done, i, j, tier_keep))
            if shared is not None:
                mark_pending(tier_keep, done)
        if held_until:
            push(held, (held_until, i, j, new))
        end = done + out_len * tpot
        push(sh, end)
        if gaps_possible:
            when, lru = computed_at[j], hbm[j]
            for h in keep:
                if h in lru and when.get(h, math.inf) > done:
                    when[h] = done
            sp = spans[j]
            while sp and sp[0][0] <= t:
                pop(sp)
            push(sp, (end, s))
        if sender is not None:
            sender.ended(i, end)
        kvb = -(-(n + out_len) // bs)
        push(events, (done, 0, j, uncached))
        push(events, (end, 1, j, kvb))
        if engine:
            if s > t:
                engine.wait(j)
                push(events, (s, 2, j, kvb))
            else:
                engine.start(j, kvb, inv_cap, waited=False)
        if booked:
            booked.add(j, req.block_hashes, end, i)
        queued[j] = queued_l[j] = queued_l[j] + 1
        pending[j] = pending_l[j] = pending_l[j] + uncached
        a = active_l[j] = active_l[j] + kvb
        kv_usage[j] = kv_l[j] = min(a * inv_cap, 1.0)
        if end > last_end:
            last_end = end
        # metrics
        ttfts.append(done - t)
        prompt_r[j] += n
        hit_r[j] += shared_t
        computed_r[j] += uncached
        reqs_r[j] += 1
        busy_r[j] += service
        hbm_tokens += hbm_t
        host_tokens += host_t - hbm_t
        shared_tokens += shared_t - host_t
        frac_sum += shared_t / n
        out_tokens += out_len
        if progress is not None:
            progress.update(1)

    tier_tokens = {"hbm": hbm_tokens, "host": host_tokens, "shared": shared_tokens}
    res = summarize(
        cfg,
        rids,
        arrivals,
        ttfts,
        Tally(prompt_r, hit_r, computed_r, reqs_r, busy_r, tier_tokens, frac_sum, out_tokens, last_end),
        index,
        time.perf_counter() - t_wall,
    )
    res["held_for_tier"] = holds
    return res


def chunk_rows(m: np.ndarray, chunk: int) -> None:
    """Cut a match's tier rows (hbm, host-or-hbm, any tier) to whole chunks of `chunk` blocks, never below
    the row above: what the engine loads from LMCache, in place (`TierTracker.loadable` for the live
    router)."""
    np.maximum(m[0], m[1] // chunk * chunk, out=m[1])
    np.maximum(m[1], m[2] // chunk * chunk, out=m[2])


def pending_prefix(ids, start: int, top: int, pending_store: dict, chunk: int = 1) -> tuple[int, float]:
    """(where the longest run of `ids` from `start`, at most to `top`, whose blocks all have a tier write
    pending ends, in whole chunks of `chunk` blocks; when the last of those writes lands). (0, 0.0) when it
    covers no whole chunk past `start`. What a request placed on a replica holding `start` blocks could load
    by waiting for the prefills in flight, as the live router finds it (`tier_hold.loadable_source`)."""
    k, ready, ready_at_chunk = start, 0.0, 0.0
    while k < top:
        when = pending_store.get(ids[k])
        if when is None:
            break
        ready = when if when > ready else ready
        k += 1
        if k % chunk == 0:
            ready_at_chunk = ready
    k = k // chunk * chunk
    return (k, ready_at_chunk) if k > start else (0, 0.0)


def inflight_prefix(ids, held: np.ndarray, pending_store: dict, chunk: int = 1) -> tuple[np.ndarray | None, float]:
    """(per replica, the longest prefix of `ids` it could load from the shared tier once the prefills in
    flight are stored, in whole chunks of `chunk` blocks, or None when that adds nothing anywhere; when the
    last of those blocks is stored). `held` is each replica's longest prefix now (any tier);
    `pending_store` maps a block being computed to when its tier write lands."""
    k, ready = pending_prefix(ids, int(held.min()), len(ids), pending_store, chunk)
    if not k:
        return None, 0.0
    return np.maximum(held, k), ready


@dataclass
class Tally:
    """What a run counted, per replica (lists indexed like `rids`) and in total."""

    prompt_r: list
    hit_r: list
    computed_r: list
    reqs_r: list
    busy_r: list
    tier_tokens: dict
    frac_sum: float
    out_tokens: int
    last_end: float


def summarize(
    cfg: SimConfig, rids: list, arrivals: list, ttfts: list, t: Tally, index: PrefixIndex, wall: float
) -> dict:
    """The per-policy metrics dict from what a run counted (`ttfts` is sorted in place)."""
    N = len(rids)
    n_req = len(ttfts)
    prompt = sum(t.prompt_r)
    hit = sum(t.hit_r)
    mean_computed = sum(t.computed_r) / N
    makespan = max(t.last_end - min(arrivals, default=0.0), 1e-9)
    ttfts.sort()
    cost_usd = ((prompt - hit) * cfg.uncached_rate + hit * cfg.cached_rate) / 1e6
    return {
        "hit_rate_tokens": hit / prompt if prompt else 0.0,
        "hit_rate_requests": t.frac_sum / n_req if n_req else 0.0,
        "imbalance": (max(t.computed_r) / mean_computed) if mean_computed else 1.0,
        "ttft_p50_s": nearest_rank(ttfts, 0.50) if ttfts else 0.0,
        "ttft_p90_s": nearest_rank(ttfts, 0.90) if ttfts else 0.0,
        "ttft_p99_s": nearest_rank(ttfts, 0.99) if ttfts else 0.0,
        "throughput_tokens_s": (prompt + t.out_tokens) / makespan,
        "blended_cost": cost_usd,
        # extras
        "blended_cost_per_mtok": cost_usd / prompt * 1e6 if prompt else 0.0,
        "hit_rate_hbm_tokens": t.tier_tokens["hbm"] / prompt if prompt else 0.0,
        "hit_tokens_by_tier": t.tier_tokens,
        "prompt_tokens": prompt,
        "cached_tokens": hit,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
        "utilization": sum(t.busy_r) / (N * makespan),
        "requests_imbalance": max(t.reqs_r) / (n_req / N) if n_req else 1.0,
        "per_replica": {
            rids[k]: {
                "requests": t.reqs_r[k],
                "prompt_tokens": t.prompt_r[k],
                "prefill_tokens": t.computed_r[k],
                "hit_rate_tokens": t.hit_r[k] / t.prompt_r[k] if t.prompt_r[k] else 0.0,
            }
            for k in range(N)
        },
        "index_stats": {k: v for k, v in index.stats.items() if k in ("lookups", "hits", "admissions", "evictions")},
        "sim_wall_s": wall,
    }


def simulate(
    trace: Trace,
    cfg: SimConfig,
    policies: dict[str, Policy],
    progress: bool = False,
    client: ClosedLoop | None = None,
    routers=None,
) -> dict:
    """Run every policy on the same arrivals and return the result document (`kvmesh simulate --json`:
    config, bounds, per-policy metrics; docs/simulator.md). With `routers` (a
    `kvmesh.cluster.multi_router.RouterSetup`), each policy runs in that many routers, each with its
    own copy of the policy as given."""
    import copy
    import functools

    from kvmesh.cluster.bounds import compute_bounds

    cfg.check()
    arrivals, offered = arrivals_for(trace, cfg)  # with a closed-loop client, the open-loop reference
    n_nodes = len({i // cfg.replicas_per_node for i in range(cfg.replicas)})
    doc: dict[str, Any] = {
        "trace": trace.name,
        "replicas": cfg.replicas,
        "capacity_blocks": cfg.capacity_blocks,
        "requests": len(trace),
        "bounds": compute_bounds(
            trace.requests,
            trace.block_size,
            cfg.replicas,
            cfg.capacity_blocks,
            n_nodes * cfg.host_blocks,
            cfg.shared,
            cfg.shared_blocks,
        ),
        "policies": {},
        "config": {
            "block_size": trace.block_size,
            # tokens one trace hash id stands for: the block size, unless the ids were expanded (`engine_trace`)
            "tokens_per_block": trace.meta.get("tokens_per_block", trace.block_size),
            # the cap on each request's decoded tokens, as a replay's `--max-tokens` (None: the trace's lengths)
            "max_tokens": trace.meta.get("max_tokens"),
            "limit": trace.meta.get("limit"),
            "host_blocks": cfg.host_blocks,
            "shared": cfg.shared,
            "shared_blocks": cfg.shared_blocks,
            "replicas_per_node": cfg.replicas_per_node,
            "tier_store_at": cfg.tier_store_at,
            "tier_chunk_blocks": cfg.tier_chunk_blocks,
            "load": offered,
            "load_definition": "offered prefill work with no reuse / fleet prefill capacity",
            "span_s": arrivals[-1] - arrivals[0],
            "cost_model": cfg.cost.to_dict(),
            "closed_loop_concurrency": client.concurrency if client is not None and client.arrivals is None else None,
            "send": "timestamps"
            if client is None
            else "closed loop"
            if client.arrivals is None
            else "timed, turns after replies",
            "uncached_rate_per_mtok": cfg.uncached_rate,
            "cached_rate_per_mtok": cfg.cached_rate,
            "seed": cfg.seed,
            # the multi-router model's setup (`multi_router.RouterSetup`); one all-knowing router without it
            "routers": 1 if routers is None else routers.routers,
            "event_delay_s": 0.0 if routers is None else routers.delay_s,
            "router_sync": True if routers is None else routers.sync,
            "churn_every_s": None if routers is None else routers.churn_every_s,
        },
    }
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(trace) * len(policies), unit="req", desc="simulate", leave=False, disable=None, mininterval=0.5
        )  # disable=None: silent when stderr is not a terminal
    try:
        for name, pol in policies.items():
            if bar is not None:
                bar.set_postfix_str(name)
            if routers is not None:
                from kvmesh.cluster.multi_router import simulate_routers

                fresh = functools.partial(copy.deepcopy, pol)
                doc["policies"][name] = simulate_routers(trace, cfg, fresh, routers, arrivals, client)
                if bar is not None:
                    bar.update(len(trace))
                continue
            doc["policies"][name] = simulate_policy(trace, cfg, pol, None if client else arrivals, bar, client)
    finally:
        if bar is not None:
            bar.close()
    return doc

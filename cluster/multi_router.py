"""The fleet simulated with R routers, each with its own view, seeing engines and each other late.

`kvmesh.cluster.simulator` models one router that knows every cache change and every queue at once.
Live, each ingress replica runs its own router: its own `PrefixIndex`, its own policy instance (guard
work, hot-prefix fanout, commitments), its own load view. This module replays a trace through R such
routers over one ground-truth fleet (the same caches, tiers and time model as the simulator), with:

- engine events delayed by `delay_s` (vLLM's event batching plus the network): KV stores/evictions
  and load changes (a request queued, prefilled, finished) reach every router `delay_s` after they
  happen. A router knows its own placements at once: it speculates the request's blocks on the
  chosen replica and counts the request in that replica's queue.
- router sync (`sync=True`): each router publishes its decisions (request, replica, the replica as it
  ranked it, the blocks it speculated); the others apply them `delay_s` later, the same
  `Policy.on_routed` and the same speculation as their own, so their guard work and fanout include
  the whole fleet's traffic. Each router also counts the peers' decisions it has not heard of yet
  (`peer_lag.UnseenPlacements`, the live router's estimate: peers' rate times the lag) and hands
  the count to the policy (`FleetView.unseen_placements`), which spreads new prefixes over where those
  may have gone instead of sending every router's to the one replica the shared stale view ranks
  first. Without sync a router never learns the others' decisions, only what the engines report.
- replica churn (`churn_every_s`): every interval one replica (in turn) leaves and a new one, with a
  new id and an empty HBM cache, joins in its place on the same node (its host tier stays warm).
  Routers drop the old one and add the new one at once (the control plane's replica set, not the
  event stream): `PrefixIndex.remove_replica`/`add_replica`, `Policy.on_replica_removed`/`added`. The new
  one takes over the old one's accelerator (one per replica, as the capacity model has it): what the old
  one had accepted drains first (its requests keep the TTFT they were given), and the newcomer's prefills
  queue behind it; the routers see that work as the slot's load until it ends, as they would see a replica
  that is not ready yet, rather than an idle one. (Starting it on an idle accelerator of its own, beside
  the draining one, would count two accelerators in one slot: utilisation above 1 and throughput above
  the fleet's under fast churn.)

Requests go to routers round robin: an HTTP front or L4 balancer spreads connections, not users, so
consecutive turns of one conversation usually land on different routers (the hard case for a
per-router view). With R=1 and no delay this is exactly `simulator.simulate_policy` (tested), and so
is any R with sync and no delay: every router then applies the same calls in the same order.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvmesh.cluster.block_cache import BlockLRU
from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.simulator import (
    ClosedLoop,
    SimConfig,
    Tally,
    chunk_rows,
    fleet_caches,
    fleet_layout,
    send_plan,
    summarize,
)
from kvmesh.cluster.trace import Trace
from kvmesh.deployments.peer_lag import UnseenPlacements, is_free_choice
from kvmesh.policies.base import FleetView, Policy, RequestInfo
from kvmesh.policies.cost_model import cacheable_blocks, cached_tokens

# message kinds on the event stream (engine events and, with sync, router decisions)
_KV, _LOAD, _ROUTE = 0, 1, 2
_ENGINE = -1  # origin of an engine's own event


@dataclass(frozen=True)
class RouterSetup:
    routers: int = 1
    delay_s: float = 0.0  # engine events and router sync reach a router this late
    sync: bool = True  # routers publish their decisions to each other
    churn_every_s: float | None = None  # one replica replaced by a cold one per interval

    def check(self) -> None:
        if self.routers < 1:
            raise ValueError("routers must be >= 1")
        if not self.delay_s >= 0:
            raise ValueError("event delay must be >= 0")
        if self.churn_every_s is not None and not self.churn_every_s > 0:
            raise ValueError("churn interval must be > 0")


class _Router:
    """One router's view: its index, policy, load arrays, and how far it has read the event stream."""

    def __init__(self, n: int, rids: list, nodes: list, index_blocks: int, policy: Policy, capacity: int, delay: float):
        self.index = PrefixIndex(max_blocks=index_blocks, speculative_ttl_s=0.0)
        for rid, node in zip(rids, nodes):
            self.index.add_replica(rid, node)
        self.policy = policy
        for rid in rids:
            policy.on_replica_added(rid)
        self.ids = list(rids)
        self.live = set(rids)
        self.queued = np.zeros(n, dtype=np.int64)
        self.running = np.zeros(n, dtype=np.int64)
        self.pending = np.zeros(n, dtype=np.int64)
        self.active = np.zeros(n, dtype=np.int64)
        self.kv_usage = np.zeros(n)
        unset = np.zeros(n, dtype=np.int64)
        self.fleet = FleetView(
            self.ids,
            unset,
            unset,
            unset,
            self.queued,
            self.running,
            self.kv_usage,
            self.pending,
            np.full(n, capacity, dtype=np.int64),
        )
        self.read = 0  # position in the stream (absolute)
        self.inv_cap = 1.0 / capacity
        self.delay = delay
        self.unseen = UnseenPlacements()  # peers' placements not heard of yet, as the live router counts them

    def load(self, k: int, dq: int, dr: int, dp: int, da: int) -> None:
        self.queued[k] += dq
        self.running[k] += dr
        self.pending[k] += dp
        if da:
            self.active[k] += da
            self.kv_usage[k] = min(self.active[k] * self.inv_cap, 1.0)

    def apply(self, me: int, msg: tuple) -> None:
        """One message of the stream, as this router `me` sees it."""
        t, origin, kind, a, b, c, d, free = msg
        if kind == _KV:  # (tier, holder, new, evicted): holder is a replica id, node id or None
            idx = self.index
            if a == 0:
                if b in self.live:  # not a replica that left meanwhile
                    if d:
                        idx.remove(b, d)
                    if c:
                        idx.store(b, c)
            elif a == 1:
                if d:
                    idx.remove_host(b, d)
                if c:
                    idx.store_host(b, c)
            else:
                if d:
                    idx.remove_shared(d)
                if c:
                    idx.store_shared(c)
        elif kind == _LOAD:  # (slot, replica id, deltas): the report of the replica on that accelerator
            if origin != me:
                self.load(a, *c)
        elif origin != me:  # _ROUTE: another router's decision (request, replica id, view, blocks)
            self.unseen.heard(t, t + self.delay, a.num_tokens - c.shared_blocks * a.block_size, free)
            if b in self.live:
                self.index.store(b, d)
                self.policy.on_routed(a, b, c)


def check_modelled_signals(policy: Policy) -> None:
    """ValueError for a policy that reads load signals this model does not keep (the engine's waiting queue
    and allocated KV, Dynamo's booked blocks: `simulator.EngineLoad`, `ActivePromptBlocks`): it would
    silently place on other inputs than in the one-router simulator."""
    from kvmesh.cluster.simulator import ActivePromptBlocks, EngineLoad

    missing = [s for s in getattr(policy, "load_signals", ()) if s in EngineLoad.SIGNALS + ActivePromptBlocks.SIGNALS]
    if missing:
        raise ValueError(
            f"policy {getattr(policy, 'name', type(policy).__name__)} reads {', '.join(missing)}, which the "
            "multi-router simulator does not model: simulate it with one router (no --routers above 1, "
            "--router-sync, --event-delay-ms or --churn-every-s), or name the other policies"
        )


def check_tier_store_at(tier_store_at: str) -> None:
    """ValueError unless tier copies are stored when their request is routed: this model keeps no prefill end
    to store them at (`SimConfig.tier_store_at` "computed")."""
    if tier_store_at != "routed":
        raise ValueError(
            f"tier_store_at {tier_store_at!r} is modelled by the one-router simulator only: drop --routers, "
            "--router-sync, --event-delay-ms and --churn-every-s, or use --tier-store-at routed"
        )


def simulate_routers(
    trace: Trace,
    cfg: SimConfig,
    make_policy: Callable[[], Policy],
    setup: RouterSetup,
    arrivals: list[float] | None = None,
    client: ClosedLoop | None = None,
) -> dict:
    """Replay `trace` through `setup.routers` routers (each with its own policy from `make_policy`);
    returns `simulate_policy`'s metrics dict plus `routers` (the setup and churn counts). Tier copies are
    stored when their request is routed (`SimConfig.tier_store_at` "routed"); "computed" is refused.
    With `client` (`ClosedLoop`), it decides when each request is sent, as in `simulate_policy`: a
    chat user's next turn goes no earlier than its previous reply's end."""
    cfg.check()
    setup.check()
    check_tier_store_at(cfg.tier_store_at)
    sender, arrivals = send_plan(trace, cfg, arrivals, client)
    c = cfg.cost
    bs = trace.block_size
    N = cfg.replicas
    R = setup.routers
    delay = setup.delay_s
    rids, nodes, index_blocks = fleet_layout(cfg)
    routers = [_Router(N, rids, nodes, index_blocks, make_policy(), cfg.capacity_blocks, delay) for _ in range(R)]
    check_modelled_signals(routers[0].policy)
    hbm, host, shared = fleet_caches(cfg, nodes)
    tierless = not host and shared is None
    synced = R > 1 and setup.sync
    chunk = cfg.tier_chunk_blocks

    # ground truth, as in simulate_policy; events carry the replica id so a replaced replica's are dropped
    events: list[tuple[float, int, int, int, str]] = []
    server_free = [0.0] * N
    slot_heap: list[list[float]] = [[] for _ in range(N)]
    stream: list[tuple] = []  # (time, origin, kind, a, b, c, d, free), in time order; free: routes only
    base = 0  # absolute position of stream[0]
    push, pop = heapq.heappush, heapq.heappop
    next_churn = setup.churn_every_s if setup.churn_every_s is not None else float("inf")
    churned = 0
    t0 = arrivals[0] if arrivals else 0.0
    every = setup.churn_every_s or float("inf")

    prompt_r = [0] * N
    hit_r = [0] * N
    computed_r = [0] * N
    reqs_r = [0] * N
    busy_r = [0.0] * N
    tier_tokens = {"hbm": 0, "host": 0, "shared": 0}
    ttfts: list[float] = []
    frac_sum = 0.0
    out_tokens = 0
    last_end = 0.0
    t_wall = time.perf_counter()

    def kv_message(when: float, tier: int, holder, new, evicted) -> None:
        if new or evicted:
            stream.append((when, _ENGINE, _KV, tier, holder, new, evicted, None))

    order = sender if sender is not None else enumerate(arrivals)
    for sent, (i, t) in enumerate(order):
        r = trace.requests[i]
        arrivals[i] = t
        while events and events[0][0] <= t:
            when, kind, k, val, rid = pop(events)  # a replaced replica's too: its accelerator's work goes on
            delta = (-1, 1, -val, 0) if kind == 0 else (0, -1, 0, -val)
            stream.append((when, _ENGINE, _LOAD, k, rid, delta, None, None))
        due = int((t - t0 - next_churn) // every) + 1 if t - t0 >= next_churn else 0
        if due > N:  # replaced again before any request saw them: only the last N churns leave a trace
            churned += due - N
            next_churn += (due - N) * every
        replaced_now = 0  # bounded too where an interval below the clock's resolution never moves next_churn on
        while t - t0 >= next_churn and replaced_now < N:  # replace one replica by a cold one
            replaced_now += 1
            k = churned % N
            old, new_id = rids[k], f"r{k}.{churned // N + 1}"
            rids[k] = new_id
            hbm[k] = BlockLRU(cfg.capacity_blocks)  # on the departing one's accelerator: `server_free` and the
            # batch slots go on, so the prefills and decodes it accepted run before the newcomer's, as they would
            for rt in routers:
                rt.index.remove_replica(old)
                rt.policy.on_replica_removed(old)
                rt.index.add_replica(new_id, nodes[k])
                rt.policy.on_replica_added(new_id)
                if rt.index.slot_of(new_id) != k:
                    raise RuntimeError("prefix index did not reuse the departed replica's slot")
                rt.ids[k] = new_id
                rt.live.discard(old)
                rt.live.add(new_id)  # its load stays: the work the departing replica accepted still runs there
            churned += 1
            next_churn += setup.churn_every_s  # type: ignore[operator]
        me = sent % R  # the HTTP front spreads requests over the routers in the order they come
        rt = routers[me]
        # deliver what happened at least `delay` ago
        horizon = t - delay
        pos = rt.read - base
        end = len(stream)
        while pos < end and stream[pos][0] <= horizon:
            rt.apply(me, stream[pos])
            pos += 1
        rt.read = pos + base
        if sent % 4096 == 0 and stream:  # drop what every router has read
            low = min(x.read for x in routers) - base
            if low > 0:
                del stream[:low]
                base += low

        ids = r.hash_ids
        n = r.input_length
        fleet = rt.fleet
        m = rt.index.match_arrays(ids, N)
        if tierless:
            fleet.hbm_blocks = fleet.host_blocks = fleet.shared_blocks = m[0]
        else:
            if chunk > 1:
                chunk_rows(m, chunk)
            fleet.hbm_blocks, fleet.host_blocks, fleet.shared_blocks = m[0], m[1], m[2]
        req = RequestInfo(ids[: n // bs], n, bs, r.output_length, r.tenant, str(i))
        if synced:
            fleet.unseen_placements, fleet.unseen_tokens = rt.unseen.estimate(t)
        j = rt.policy.best(req, fleet)
        if j is None:
            raise RuntimeError("policy placed a request nowhere")
        rid = rids[j]
        view = fleet.view(j)
        rt.policy.on_routed(req, rid, view)

        # ground truth: what the chosen replica and the tiers hold (the tiers' part in whole chunks)
        j_hbm = hbm[j]
        hbm_t = cached_tokens(j_hbm.prefix_len(ids), n, bs)
        host_t = hbm_t
        if host:
            either = _either_prefix(ids, j_hbm, host[nodes[j]]) // chunk * chunk
            host_t = max(hbm_t, cached_tokens(either, n, bs))
        shared_t = host_t
        if shared is not None:
            anywhere = _any_prefix(ids, j_hbm, host.get(nodes[j]), shared) // chunk * chunk
            shared_t = max(host_t, cached_tokens(anywhere, n, bs))
        uncached = n - shared_t
        keep = ids[: cacheable_blocks(n, len(ids), bs)]
        new, evicted = j_hbm.admit(keep)
        # this router speculates at once, the blocks the replica keeps (a prompt longer than its cache keeps its
        # first blocks only); with sync the others learn the decision `delay` later
        spec = [h for h in keep if h in j_hbm] if evicted else keep
        if spec:
            rt.index.store(rid, spec)
        if synced:
            stream.append((t, me, _ROUTE, req, rid, view, spec, is_free_choice(fleet.shared_blocks)))
        kv_message(t, 0, rid, new, evicted)
        tier_keep = keep[: len(keep) // chunk * chunk] if chunk > 1 else keep
        if host:
            new, evicted = host[nodes[j]].admit(tier_keep)
            kv_message(t, 1, nodes[j], new, evicted)
        if shared is not None:
            new, evicted = shared.admit(tier_keep)
            kv_message(t, 2, None, new, evicted)
        # time
        service = c.prefill_s(n, hbm_t, host_t, shared_t)
        s = t if t > server_free[j] else server_free[j]
        sh = slot_heap[j]
        while sh and sh[0] <= s:
            pop(sh)
        if len(sh) >= c.max_batch:
            e = pop(sh)
            s = e if e > s else s
        done = s + service
        server_free[j] = done
        end_t = done + r.output_length * c.decode_s_per_token
        push(sh, end_t)
        if sender is not None:
            sender.ended(i, end_t)
        kvb = -(-(n + r.output_length) // bs)
        push(events, (done, 0, j, uncached, rid))
        push(events, (end_t, 1, j, kvb, rid))
        rt.load(j, 1, 0, uncached, kvb)  # this router knows at once; the others when the engine reports
        stream.append((t, me, _LOAD, j, rid, (1, 0, uncached, kvb), None, None))
        if end_t > last_end:
            last_end = end_t
        ttfts.append(done - t)
        prompt_r[j] += n
        hit_r[j] += shared_t
        computed_r[j] += uncached
        reqs_r[j] += 1
        busy_r[j] += service
        tier_tokens["hbm"] += hbm_t
        tier_tokens["host"] += host_t - hbm_t
        tier_tokens["shared"] += shared_t - host_t
        frac_sum += shared_t / n
        out_tokens += r.output_length

    # what is still in flight reaches the routers after the last request: the index's counts then cover every
    # engine event, the last request's tier stores included (with one router and no delay, the plain simulator's)
    for me, x in enumerate(routers):
        for msg in stream[x.read - base :]:
            x.apply(me, msg)
    out = summarize(
        cfg,
        [f"r{k}" for k in range(N)],  # per accelerator: a replaced replica's figures stay with its slot
        arrivals,
        ttfts,
        Tally(prompt_r, hit_r, computed_r, reqs_r, busy_r, tier_tokens, frac_sum, out_tokens, last_end),
        routers[0].index,
        time.perf_counter() - t_wall,
    )
    out["held_for_tier"] = 0  # tier copies are stored when routed here, so nothing waits for one
    out["routers"] = {
        "routers": R,
        "event_delay_s": delay,
        "sync": setup.sync,
        "assignment": "round robin",
        "replicas_replaced": churned,
        # the widest slot each router's index uses: stays at the fleet size however many replicas came and went
        "index_slots": max(max(x.index.slot_of(rid) for rid in x.ids) + 1 for x in routers),
    }
    return out


def _either_prefix(ids, a: BlockLRU, b: BlockLRU) -> int:
    """Leading blocks held in `a` or `b` (a replica's hbm or its node's host tier)."""
    i = 0
    for h in ids:
        if h not in a and h not in b:
            break
        i += 1
    return i


def _any_prefix(ids, a: BlockLRU, b: BlockLRU | None, s: BlockLRU) -> int:
    """Leading blocks held in hbm, host (if any) or the shared tier."""
    i = 0
    for h in ids:
        if h not in a and h not in s and (b is None or h not in b):
            break
        i += 1
    return i

"""The router's hold for a prefix in flight: with LMCache, a request whose prefix another replica is computing
now waits for that prefill's first token and loads the prefix, rather than compute it again.

`KvmeshRouter` mixes these steps in (ranking calls `_add_inflight` and `_plan_hold`, then `_hold`); which
in-flight request a prefix can be loaded from, and the pace first tokens have been coming at, are the pure
pieces in `tier_hold`. Kept apart from the router because they are one mechanism with one state (the
held requests, the pace, the hold counters) and their own tests (tests/unit/deployments/test_router_tier_hold.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import predicted_cached_tokens
from kvmesh.deployments.tier_hold import PrefillPace, loadable_source, loadable_sources, pace_of_waiting, prefixes_from
from kvmesh.policies.base import FleetView, ReplicaView, RequestInfo

if TYPE_CHECKING:
    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.cluster.tier_tracker import TierTracker
    from kvmesh.deployments.router import _Inflight, _Routing
    from kvmesh.deployments.router_sync import PeerPlacements


def queue_wait_s(policy, info: RequestInfo, view) -> float:
    """How long `policy` predicts `info` would wait on a replica ranked as `view` before its prefill starts: its
    predicted TTFT there less its TTFT on the same replica with nothing queued, running or pending (for
    `KvmeshPolicy`, the `wait` its ranking weighs a hold's extra wait against: `_keys`). 0 when the policy
    predicts nothing."""
    predict = getattr(policy, "predict", None)
    if predict is None or view is None:
        return 0.0
    idle = dataclasses.replace(view, queued=0, running=0, pending_prefill_tokens=0)
    return max(float(predict(info, view)[0]) - float(predict(info, idle)[0]), 0.0)


@dataclasses.dataclass
class HoldPlan:
    """`TierHolding._plan_hold`'s answer where it counted a prefix in flight in the replica ranked first:
    `src` leaves it loadable there; `held`: the request waits for it (`_hold`), else it is credited without
    a hold; `wait_s`: the seconds until `src`'s prefill is predicted to end, at the measured pace (0 once its
    first token is back); `before`: that replica's match and view without the prefix."""

    src: Any
    held: bool
    wait_s: float
    before: tuple


def _in_time(left_s: float, pace: float, queue_s: float) -> bool:
    """Is a prefill with `left_s` seconds left at the measured `pace` predicted to be stored before a request
    queued `queue_s` (the policy's predicted seconds: `queue_wait_s`) would start its own? The queue is taken
    at the same pace: the pace measures placement to first token, the queue's wait included, on the same
    engines. A source past its predicted end at that pace without its first token (0 left) is late, not
    stored: never in time (the hold waits for a late source too, `_wait_for_source`)."""
    return 0.0 < left_s < pace * queue_s


async def _either(a: asyncio.Event, b: asyncio.Event | None, timeout: float) -> bool:
    """Wait until `a` or `b` (when given) is set, `timeout` seconds at most: True when one was set."""
    if b is None:
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can drop a cancel that comes as `a` is set
                await a.wait()
        except TimeoutError:
            return a.is_set()
        return True
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return a.is_set() or b.is_set()


class TierHolding:
    """Holding a request for a prefix another replica is computing: the router's steps and their state."""

    hold_limit_s = 10.0  # the longest a request waits for a prefix another replica is computing
    # the share of Serve's routing tasks requests held for a prefix may occupy at once (`_may_hold`): a held
    # request waits inside `choose_replicas`, i.e. in one of those tasks, and with all of them held no other
    # request is ranked at all, however free the replicas are
    hold_task_share = 0.5

    if TYPE_CHECKING:  # the router's own state and steps these read and call
        _inflight: dict[str, _Inflight]
        _routing: dict[str, _Routing]
        peers: PeerPlacements
        tiers: TierTracker
        index: PrefixIndex

        def _commit(self, routing: _Routing, rid: str, announce: bool = True) -> None: ...
        def _announce(self, routing: _Routing) -> None: ...
        def _withdraw(self, routing: _Routing, publish: bool = True) -> None: ...
        def _placeable(self, rid: str) -> bool: ...

    def _init_holds(self) -> None:
        # requests this router holds for a prefix in flight, not sent yet: others may wait for their own
        # prefill too (moved to `_inflight` once Serve places them)
        self._held: dict[str, _Inflight] = {}
        # requests held for a prefix another replica was computing (`_hold`), and holds that
        # ran out before its first token came back
        self.held_for_tier = 0
        self.hold_timeouts = 0
        self.holding = 0  # requests waiting in `_hold` now, each in one of Serve's routing tasks
        self.holds_full = 0  # rankings with prefills in flight while `_may_hold` allowed no more holds
        self.prefill_pace = PrefillPace()  # how much slower than predicted first tokens come (hold limits)
        # per source (by id), the requests credited its prefix without a hold, taken back should it be
        # released without a first token (`_credit_unheld`): (the source, [(internal, routing, match and view
        # before)], the task waiting for its release)
        self._unheld_credits: dict[int, tuple[Any, list, asyncio.Task]] = {}

    def _hold_sources(self):
        """Every request a new one may wait for: this router's in flight and held ones, and its peers', less
        those on suspect replicas (`replica_watch`): a frozen replica's prefill may never end, and waiting
        for it would hold a request to its hold limit."""
        sources = itertools.chain(self._inflight.values(), self._held.values(), self.peers.placements.values())
        watch = getattr(self, "watch", None)
        if watch is None or not watch.suspect:
            return sources
        return (s for s in sources if s.replica not in watch.suspect)

    def _may_hold(self, listed: int) -> bool:
        """May one more request be held now? Serve runs at most `max_num_routing_tasks` routing tasks (2 per
        replica, at most 50); holds may take `hold_task_share` of them, so the rest go on ranking the requests
        not held. `listed`: the replicas Serve asked about, for a router driven outside Serve (no replicas of
        its own: no routing tasks to count)."""
        tasks = getattr(self, "max_num_routing_tasks", 0) or min(50, 2 * listed)
        return self.holding < int(tasks * self.hold_task_share)

    def _drop_held(self, internal: str) -> None:
        """A held request that will not be sent as held (cancelled, ranked again, its replica gone): requests
        waiting for its prefill go on without it."""
        st = self._held.pop(internal, None)
        if st is not None:
            st.release()

    def _add_inflight(
        self,
        info: RequestInfo,
        fleet: FleetView,
        may_hold: bool = True,
        policy=None,
        views: dict[str, ReplicaView] | None = None,
    ) -> dict:
        """Tell the policy what each replica could load once a prefill in flight elsewhere (this router's or
        a peer's) is stored (`FleetView.inflight_blocks`), and when, in the policy's seconds at the measured
        pace (`inflight_ready_s`), so it can score holding for it on any replica, not only keep a new prompt's
        later requests on the replica computing it. Returns replica -> the source found for it
        (`tier_hold.loadable_sources`), for the hold that follows ranking. Without `may_hold` (no hold is
        allowed now: `_may_hold`), only prefixes the request will find stored without a hold count on each
        replica (`_in_time` on `views`, with `policy`): the policy must not rank a replica first for a
        hold the request will not get, nor lose a credit that needs none."""
        sources = self._hold_sources()
        have = fleet.shared_blocks.tolist()
        if may_hold:
            found = loadable_sources(info.block_hashes, info.request_id, fleet.ids, have, sources, self.tiers)
        else:
            self.holds_full += 1
            found = self._unheld_sources(info, fleet.ids, have, sources, policy, views or {})
        # the rest of the prefill in the policy's predicted seconds at the measured pace: what the policy
        # compares with its predicted queue wait
        blocks, ready_s = prefixes_from(found, have, self._policy_left_s)
        if blocks is not None:
            fleet.inflight_blocks = np.asarray(blocks, dtype=np.int64)
            fleet.inflight_ready_s = ready_s
        return dict(zip(fleet.ids, found))

    def _policy_left_s(self, src) -> float:
        """`_prefill_left` in the policy's predicted seconds (the time left over the measured pace)."""
        left, pace = self._prefill_left(src)
        return left / pace

    def _unheld_sources(self, info: RequestInfo, ids, have, sources, policy, views: dict) -> list:
        """`loadable_sources` with only the sources whose prefix each replica would find stored without a
        hold (`_in_time`)."""
        first = info.block_hashes[:1]
        # a source sharing none of the prompt leaves nothing loadable: not weighed (chained hashes)
        related = [s for s in sources if first and s.info.block_hashes[:1] == first]
        lefts: dict[int, tuple[float, float]] = {}
        found = []
        for rid, own in zip(ids, have):
            queue: list[float] = []  # worked out once, for the first source not stored yet

            def usable(src, rid=rid, queue=queue) -> bool:
                if src.first_token:
                    return True
                if not queue:
                    queue.append(queue_wait_s(policy, info, views.get(rid)))
                if id(src) not in lefts:
                    lefts[id(src)] = self._prefill_left(src)
                return _in_time(*lefts[id(src)], queue[0])

            kept = (s for s in related if usable(s))
            found.append(loadable_source(info.block_hashes, info.request_id, rid, own, kept, self.tiers))
        return found

    def _prefill_left(self, src) -> tuple[float, float]:
        """(seconds until `src`'s prefill is predicted to end at the pace first tokens have been coming, 0 when
        that time has passed; that pace, `_pace`): the pace the hold's own limit takes (`_wait_for_source`)."""
        pace = self._pace(src)
        return max(src.prefill_end_s(pace) - time.monotonic(), 0.0), pace

    def _plan_hold(
        self,
        info: RequestInfo,
        matches: dict,
        views: dict,
        top: str,
        policy,
        known: dict | None = None,
        may_hold: bool = True,
    ) -> HoldPlan | None:
        """When another replica is computing a longer prefix of this request than `top` (the replica ranked
        first) can serve, and LMCache will leave it loadable on `top` (`tier_hold.loadable_source`): count
        that prefix in `top`'s match and view as tier-resident, so the policy's credit and the predicted cached
        tokens include it, where the request will find it stored without a hold or is held for it. Without a
        hold (`HoldPlan.held` False): the computing request's first token is back (stored already), or its
        prefill is predicted, at the pace first tokens have been coming (`_prefill_left`, as the hold's own
        limit), to end before the request's own would start on `top` (`queue_wait_s` at that pace: the wait
        behind `top`'s queue, which the request spends there anyway, and vLLM looks the prefix up when it
        schedules the prefill; `_in_time`). Else the hold costs only the wait beyond that queue, and when the
        policy finds it worth it (`Policy.hold_worth`, in the policy's predicted seconds, weighed as the
        policy's ranking and the simulator weigh it) and `may_hold` (`_may_hold`), the plan holds it (`_hold`);
        otherwise nothing changes (returns None). `known`: the sources `_add_inflight` found per replica just
        before ranking, when it ran (nothing has changed since), so the in-flight requests are not scanned
        again."""
        have = matches.get(top, (0, 0, 0))
        if not (self._inflight or self._held or self.peers.placements) or not self.tiers.any_node():
            return None
        if known is not None and top in known:
            found = known[top]
        else:
            sources = self._hold_sources()
            found = loadable_source(info.block_hashes, info.request_id, top, have[2], sources, self.tiers)
        if found is None:
            return None
        src, blocks = found
        left = 0.0  # the rest of the source's prefill, in seconds at the measured pace
        hold = False
        if not src.first_token:
            left, pace = self._prefill_left(src)
            queue_s = queue_wait_s(policy, info, views.get(top))  # the policy's predicted seconds
            hold = not _in_time(left, pace, queue_s)
            if hold:
                n, bs = info.num_tokens, info.block_size
                cached = predicted_cached_tokens(have[0], blocks, n, bs)
                missing = cached - predicted_cached_tokens(have[0], have[2], n, bs)
                # the policy's seconds: its recompute time is predicted as the queue is (a late source: 0)
                if not policy.hold_worth(missing, max(left / pace - queue_s, 0.0)):
                    return None
                if not may_hold:
                    return None
        before = (have, views.get(top))
        same_node = self.index.node_of(src.replica) == self.index.node_of(top)
        host = max(have[1], blocks) if same_node else have[1]
        matches[top] = (have[0], host, max(have[2], blocks))
        view = views.get(top)
        if view is not None:
            views[top] = dataclasses.replace(view, host_blocks=host, shared_blocks=max(have[2], blocks))
        return HoldPlan(src, hold, left, before)

    def _credit_unheld(self, plan: HoldPlan, internal: str, routing: _Routing) -> None:
        """`routing` (Serve's `internal`) was committed to its replica credited `plan.src`'s prefix without a
        hold, its first token not back yet: should that source be released without one (it failed, moved,
        was cancelled, its replica or router left), the request finds no prefix stored and computes it, so the
        credit is taken back then (`_take_back_credits`)."""
        src = plan.src
        if src.first_token:
            return
        entry = self._unheld_credits.get(id(src))
        if entry is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on a loop (a test's direct call): nothing would ever release it
                return
            # the event now: a source released before the task first runs must find it to set
            task = loop.create_task(self._take_back_when_released(src, src.released()))
            entry = self._unheld_credits[id(src)] = (src, [], task)
        entry[1].append((internal, routing, routing.replica, plan.before))

    async def _take_back_when_released(self, src, released: asyncio.Event) -> None:
        await released.wait()
        self._take_back_credits(src)

    def _take_back_credits(self, src) -> None:
        """`src` was released: if without its first token, each request credited its prefix without a hold
        (`_credit_unheld`) and still committed there, its own prefill not started yet (no first token), is
        counted as computing it after all: its match and view as before the credit, its pending prefill
        (`uncached`, in `_inflight` once sent), its policy's credited work, and its prediction in the ledger
        (while not delivered yet). Its peers keep what its placement message told them until its first token."""
        entry = self._unheld_credits.pop(id(src), None)
        if entry is None or src.first_token:
            return
        for internal, routing, rid, (have, view) in entry[1]:
            st = self._inflight.get(internal)
            if st is not None and st.routing is not routing:
                st = None  # another call of the request (ranked again, retried)
            if st is None and self._routing.get(internal) is not routing:
                continue  # ended, or ranked again: its new commitment was weighed afresh
            if routing.replica != rid or (st is not None and (st.first_token or st.replica != rid)):
                continue  # placed elsewhere (credited nothing there), or its own prefill is over
            info = routing.info
            routing.policy.on_unrouted(info, rid)
            routing.matches[rid] = have
            if view is not None:
                routing.views[rid] = view
            n, bs = info.num_tokens, info.block_size
            routing.uncached = n - predicted_cached_tokens(have[0], have[2], n, bs)
            if self.index.has_replica(rid):
                routing.policy.on_routed(info, rid, routing.views.get(rid))
            if st is None:
                continue  # not sent yet: `_routed` predicts from `routing.uncached`
            st.uncached = routing.uncached
            ledger = local_state.LEDGER
            if info.request_id and ledger.prediction(info.request_id) is not None:
                ledger.predict(info.request_id, rid, n - routing.uncached, bs)

    async def _hold(self, routing: _Routing, internal: str, src, before: tuple, own=None) -> None:
        """Wait, committed already (`_plan_hold`) but not announced (its peers count it for its tenant only:
        `held`), until `src`'s first token is back and its prefill stored, then announce the request and let
        Serve send it. Bounded (twice the rest of the source's prefill at the measured pace, plus 0.5 s): a
        prediction that was wrong, or a source that failed, must not strand the request; it then goes without
        the prefix, and its commitment is made again without it. `own`: the held request as a source itself
        (`_held`), released when it is dropped (cancelled, or its replica dead or gone: `_forget`), which ends
        the wait at once; a request whose replica is gone is left committed, unannounced, for the caller to
        rank again (`_placeable`)."""
        self.held_for_tier += 1
        self.holding += 1
        try:
            stored = await self._wait_for_source(src, None if own is None else own.released())
        finally:
            self.holding -= 1
        if self._routing.get(internal) is not routing:
            return  # Serve already settled the request (cancelled, ranked again)
        if not self._placeable(routing.replica):
            return  # its replica died or left meanwhile: ranked again (`choose_replicas`), not sent there
        if stored:  # loaded as committed: it is sent now
            self._announce(routing)
            return
        rid = routing.replica
        self._withdraw(routing, publish=False)  # never announced: the `routed` below replaces its `held`
        have, view = before
        routing.matches[rid] = have
        if view is not None:
            routing.views[rid] = view
        self._commit(routing, rid)

    async def _wait_for_source(self, src, gone: asyncio.Event | None = None) -> bool:
        """Wait for `src`'s first token until twice the rest of its predicted prefill, from the start of the
        wait, plus 0.5 s (never over `hold_limit_s`), the prediction taken at the pace first tokens have been
        coming (`_pace`). When that time comes and the pace has grown meanwhile, the deadline moves with it:
        the first holds of a run start before any first token has measured the machine. True when its prefill
        was stored; False when it failed, went elsewhere, the wait ran out, or `gone` was set (the held
        request no longer waits: `_hold`)."""
        start = time.monotonic()
        released = src.released()

        def limit_at(pace: float) -> float:
            return min(2.0 * max(src.prefill_end_s(pace) - start, 0.0) + 0.5, self.hold_limit_s)

        pace = self._pace(src)
        limit = limit_at(pace)
        while not released.is_set():
            if gone is not None and gone.is_set():
                return False
            if await _either(released, gone, max(start + limit - time.monotonic(), 0.0)):
                continue  # one of them was set: the loop's checks tell which
            grown = self._pace(src)
            later = limit_at(grown)
            # only a deadline still ahead is one to wait for: the waiting requests' pace grows with the
            # clock itself, and a deadline it moves less than the clock would be retried here at once
            if limit >= self.hold_limit_s or grown <= pace or start + later <= time.monotonic():
                self.hold_timeouts += 1
                return False
            pace, limit = grown, later
        return bool(src.first_token)  # False: released because it failed or went elsewhere

    def _pace(self, src) -> float:
        """How many times as long as predicted first tokens take now: the pace measured on those that came
        back (`PrefillPace`), or, when more, the median of how late this router's other requests still waiting
        for theirs already are (`tier_hold.pace_of_waiting`). Why the second: at the start of a run, or when
        the machine slows down, no first token may come back for longer than a hold's limit, while every
        request in flight is already late; a source late alone (stuck) adds nothing to it."""
        now = time.monotonic()
        waiting = (
            (now - st.routed_at, st.predicted_ttft_s())
            for st in self._inflight.values()
            if not st.first_token and st is not src
        )
        return max(self.prefill_pace.value, pace_of_waiting(waiting))

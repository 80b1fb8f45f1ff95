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

from kvmesh.deployments.prediction import predicted_cached_tokens
from kvmesh.deployments.tier_hold import PrefillPace, loadable_source, loadable_sources, pace_of_waiting, prefixes_from
from kvmesh.policies.base import FleetView, RequestInfo

if TYPE_CHECKING:
    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.cluster.tier_tracker import TierTracker
    from kvmesh.deployments.router import _Inflight, _Routing
    from kvmesh.deployments.router_sync import PeerPlacements


class TierHolding:
    """Holding a request for a prefix another replica is computing: the router's steps and their state."""

    hold_limit_s = 10.0  # the longest a request waits for a prefix another replica is computing

    if TYPE_CHECKING:  # the router's own state and steps these read and call
        _inflight: dict[str, _Inflight]
        _routing: dict[str, _Routing]
        peers: PeerPlacements
        tiers: TierTracker
        index: PrefixIndex

        def _commit(self, routing: _Routing, rid: str, announce: bool = True) -> None: ...
        def _announce(self, routing: _Routing) -> None: ...
        def _withdraw(self, routing: _Routing, publish: bool = True) -> None: ...

    def _init_holds(self) -> None:
        # requests this router holds for a prefix in flight, not sent yet: others may wait for their own
        # prefill too (moved to `_inflight` once Serve places them)
        self._held: dict[str, _Inflight] = {}
        # requests held for a prefix another replica was computing (`_hold`), and holds that
        # ran out before its first token came back
        self.held_for_tier = 0
        self.hold_timeouts = 0
        self.prefill_pace = PrefillPace()  # how much slower than predicted first tokens come (hold limits)

    def _hold_sources(self):
        """Every request a new one may wait for: this router's in flight and held ones, and its peers', less
        those on suspect replicas (`replica_watch`): a frozen replica's prefill may never end, and waiting
        for it would hold a request to its hold limit."""
        sources = itertools.chain(self._inflight.values(), self._held.values(), self.peers.placements.values())
        watch = getattr(self, "watch", None)
        if watch is None or not watch.suspect:
            return sources
        return (s for s in sources if s.replica not in watch.suspect)

    def _drop_held(self, internal: str) -> None:
        """A held request that will not be sent as held (cancelled, ranked again, its replica gone): requests
        waiting for its prefill go on without it."""
        st = self._held.pop(internal, None)
        if st is not None:
            st.release()

    def _add_inflight(self, info: RequestInfo, fleet: FleetView) -> dict:
        """Tell the policy what each replica could load once a prefill in flight elsewhere (this router's or
        a peer's) is stored (`FleetView.inflight_blocks`), so it can score holding for it on any replica,
        not only keep a new prompt's later requests on the replica computing it. Returns replica -> the
        source found for it (`tier_hold.loadable_sources`), for the hold that follows ranking."""
        sources = self._hold_sources()
        have = fleet.shared_blocks.tolist()
        found = loadable_sources(info.block_hashes, info.request_id, fleet.ids, have, sources, self.tiers)
        blocks, ready_s = prefixes_from(found, have)
        if blocks is not None:
            fleet.inflight_blocks = np.asarray(blocks, dtype=np.int64)
            fleet.inflight_ready_s = ready_s
        return dict(zip(fleet.ids, found))

    def _plan_hold(
        self, info: RequestInfo, matches: dict, views: dict, top: str, policy, known: dict | None = None
    ) -> tuple[Any, float, tuple] | None:
        """When another replica is computing a longer prefix of this request than `top` (the replica ranked
        first) can serve, and LMCache will leave it loadable on `top` (`tier_hold.loadable_source`): count
        that prefix in `top`'s match and view as tier-resident, so the policy's credit and the predicted cached
        tokens include it. If the computing request's first token is back it is stored already (returns
        None); else, when the policy finds the wait worth it (`Policy.hold_worth`), returns (the source, the
        predicted wait, `top`'s match and view before) for `_hold`; otherwise changes nothing. `known`: the
        sources `_add_inflight` found per replica just before ranking, when it ran (nothing has changed since),
        so the in-flight requests are not scanned again."""
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
        wait_s = 0.0
        if not src.first_token:
            n, bs = info.num_tokens, info.block_size
            missing = predicted_cached_tokens(have[0], blocks, n, bs) - predicted_cached_tokens(have[0], have[2], n, bs)
            wait_s = src.prefill_left_s()
            if not policy.hold_worth(missing, wait_s):
                return None
        before = (have, views.get(top))
        same_node = self.index.node_of(src.replica) == self.index.node_of(top)
        host = max(have[1], blocks) if same_node else have[1]
        matches[top] = (have[0], host, max(have[2], blocks))
        view = views.get(top)
        if view is not None:
            views[top] = dataclasses.replace(view, host_blocks=host, shared_blocks=max(have[2], blocks))
        return None if src.first_token else (src, wait_s, before)

    async def _hold(self, routing: _Routing, internal: str, src, before: tuple) -> None:
        """Wait, committed already (`_plan_hold`) but not announced (its peers count it for its tenant only:
        `held`), until `src`'s first token is back and its prefill stored, then announce the request and let
        Serve send it. Bounded (twice the rest of the source's prefill at the measured pace, plus 0.5 s): a
        prediction that was wrong, or a source that failed, must not strand the request; it then goes without
        the prefix, and its commitment is made again without it."""
        self.held_for_tier += 1
        stored = await self._wait_for_source(src)
        if self._routing.get(internal) is not routing:
            return  # Serve already settled the request (cancelled, ranked again)
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

    async def _wait_for_source(self, src) -> bool:
        """Wait for `src`'s first token until twice the rest of its predicted prefill, from the start of the
        wait, plus 0.5 s (never over `hold_limit_s`), the prediction taken at the pace first tokens have been
        coming (`_pace`). When that time comes and the pace has grown meanwhile, the deadline moves with it:
        the first holds of a run start before any first token has measured the machine. True when its prefill
        was stored; False when it failed, went elsewhere, or the wait ran out."""
        start = time.monotonic()
        released = src.released()

        def limit_at(pace: float) -> float:
            return min(2.0 * max(src.prefill_end_s(pace) - start, 0.0) + 0.5, self.hold_limit_s)

        pace = self._pace(src)
        limit = limit_at(pace)
        while not released.is_set():
            try:
                await asyncio.wait_for(released.wait(), timeout=max(start + limit - time.monotonic(), 0.0))
            except TimeoutError:
                if released.is_set():
                    break
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

"""The router's view of its engine replicas: which Serve lists, which it can see into, which are dead or suspect.

`KvmeshRouter` mixes these steps in. A replica Serve adds starts cold (an empty index slot, fresh policy state)
and gets no traffic until its routing stats arrived and its KV-event stream is subscribed (`_ready`), done in the
background as soon as Serve lists it (`_subscribe_soon`). A replica that leaves, or is known dead, is forgotten
at once: its index slot, subscriber, policy state, tier node when it was the node's last, and the calls still
open on it after its drain time (`_forget`). A replica that stops answering Serve's queue-length probe is
suspect (`replica_watch`): left out of the ranking, nothing forgotten, its calls moved once it has been
suspect long enough (`_move_calls_off`). Kept apart from the ranking because membership is one mechanism with
its own state (subscriptions, back-offs, the dead and the suspect) and its own tests (test_router_suspect.py,
test_replica_loss.py, test_router_events.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import RunningReplica

from kvmesh.cluster.secure_channel import ChannelError
from kvmesh.deployments import local_state

if TYPE_CHECKING:
    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.cluster.kv_events import KVEventSubscriber
    from kvmesh.cluster.tier_tracker import TierTracker
    from kvmesh.deployments.load_report import LoadReports
    from kvmesh.deployments.replica_watch import ReplicaWatch
    from kvmesh.deployments.router import _Inflight
    from kvmesh.deployments.router_sync import PeerPlacements

log = logging.getLogger("ray.serve.kvmesh")  # Serve routes "ray.serve" logs to the replica log files


class ReplicaMembership:
    """The replicas the router routes to: added cold, subscribed, checked, forgotten, dead or suspect."""

    if TYPE_CHECKING:  # the router's own state and steps these read and call
        index: PrefixIndex
        tiers: TierTracker
        peers: PeerPlacements
        load_reports: LoadReports
        watch: ReplicaWatch
        events: KVEventSubscriber | None
        curr_replicas: dict[Any, RunningReplica]
        block_size: int
        hash_algo: str
        subscribe_events: bool
        abandon_left_after_s: float
        engine_config_mismatch: dict[str, dict[str, dict]]
        forgotten: int
        held_back: int
        passed_over_suspect: int
        _policies: dict[str, Any]
        _inflight: dict[str, _Inflight]
        _held: dict[str, _Inflight]
        _unconfirmed: Any
        _by_request_id: dict[str, str]
        _moved_off: set[str]
        _dead: set[str]
        _subscribed: set[str]
        _subscribing: set[str]
        _subscribe_failed: dict[str, tuple[int, float]]
        _config_checked: set[str]
        _sync_wanted: list[RunningReplica] | None
        _syncing: asyncio.Task | None
        _watching: asyncio.Task | None
        _loop: asyncio.AbstractEventLoop | None

        def _complete(self, rid: str, internal_request_id: str) -> None: ...
        def _current_call(self, request_id: str) -> tuple[str | None, _Inflight | None]: ...
        def _drop_held(self, internal: str) -> None: ...
        def _placeable(self, rid: str) -> bool: ...

    def _start_watch(self) -> None:
        """Probe the replicas Serve lists in the background (`ReplicaWatch.run`), from the router's loop; started
        again should its task have ended (its loop was closed)."""
        if self._watching is not None and not self._watching.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on a loop yet: the first routing call starts it
        self._watching = loop.create_task(self.watch.run(self._probed))

    def _progress_of(self, r: RunningReplica) -> tuple:
        """Signs of a replica's work for the watch: the last KV-event batch heard from it and its engine's step
        count in its routing stats (a frozen replica sends neither; a busy one both)."""
        source = self.events.sources.get(r.replica_id.unique_id) if self.events is not None else None
        return (getattr(source, "last_seq", None), (r.routing_stats or {}).get("steps"))

    def _move_calls_off(self, rid: str) -> int:
        """Give up the calls in flight on a replica suspect long enough (`ReplicaWatch.abandon_long_suspect`):
        the ingress sends each again elsewhere (deployments/migration.py). Only a request's current call, and
        once: until the ingress's new call for it is routed, its request id names that new call's wait."""
        moved = 0
        for internal, st in list(self._inflight.items()):
            request_id = st.info.request_id
            if st.replica != rid or not request_id or internal in self._moved_off:
                continue
            if self._by_request_id.get(request_id) != internal:  # an earlier call of a request that moved on
                continue
            # not awaited yet, or its request has no move left (it waits for the replica): the next round looks again
            if local_state.OPEN_CALLS.abandon([request_id], movable_only=True):
                self._moved_off.add(internal)
                moved += 1
        if moved:
            log.warning(
                "gave up %d call(s) on replica %s, suspect for %.0f s or more", moved, rid, self.watch.abandon_after_s
            )
        return moved

    def _probed(self) -> list[RunningReplica]:
        """The replicas the watch probes: those Serve lists, less those known dead."""
        return [r for r in self.curr_replicas.values() if r.replica_id.unique_id not in self._dead]

    async def _sync_replicas(self, candidates: list[RunningReplica]) -> None:
        known = set(self.index.replicas())
        current = {r.replica_id.unique_id for r in self.curr_replicas.values()} | {
            r.replica_id.unique_id for r in candidates
        }
        for rid in known - current:
            self._forget(rid)
        for r in candidates:
            rid = r.replica_id.unique_id
            if rid in self._dead:  # a list from before it died (a background sync's)
                continue
            stats = r.routing_stats or {}
            if rid not in known:
                self._add_replica(r)
            if rid not in self._config_checked:
                self._check_engine_config(rid, stats)
            if stats.get("tiers") and self.index.has_replica(rid):  # engine runs on an LMCache node server
                t = stats["tiers"]
                self.tiers.set_node(
                    self.index.node_of(rid),
                    has_shared_tier=bool(t.get("shared")),
                    host_capacity_blocks=t.get("host_capacity_blocks"),
                    chunk_blocks=t.get("chunk_blocks"),
                )
                if getattr(self, "_tier_watch", None) is None:  # shared-tier loss, server restarts
                    from kvmesh.kvstore.node_server import watch_tier_health

                    self._tier_watch = asyncio.create_task(watch_tier_health(self.tiers))
            if self._unsubscribed(r) and rid not in self._subscribing and self._may_subscribe(rid):
                self._subscribing.add(rid)  # a request ranked meanwhile must not subscribe it a second time
                try:
                    await self._subscribe(rid, stats)
                finally:
                    self._subscribing.discard(rid)

    async def _subscribe(self, rid: str, stats: dict) -> None:
        if self.events is None:
            from kvmesh.cluster.kv_events import KVEventSubscriber

            self.events = KVEventSubscriber(self.tiers)  # the index, minus LMCache chunk-hash events
        try:
            await self.events.add_source(
                rid,
                stats["kv_events_endpoint"],
                topic=stats.get("events_topic", ""),
                replay_endpoint=stats.get("replay_endpoint"),
                auth=stats.get("events_auth"),  # "curve": the engine's relay (cluster/event_relay.py)
            )
        except ChannelError as exc:  # a missing secret does not come back by retrying: say so once, route on
            self._subscribed.add(rid)
            log.error("no KV events from %s (routing on load alone): %s", rid, exc)
            return
        except Exception as exc:  # one replica's bad endpoint must not stop routing to the others
            failures = self._subscribe_failed.get(rid, (0, 0.0))[0] + 1
            wait_s = 0.5 * 2 ** min(failures, 6)  # 1 s doubling to 32 s, then every 32 s
            self._subscribe_failed[rid] = (failures, time.monotonic() + wait_s)
            log.error("cannot subscribe to the KV events of %s (not routed to; again in %.0f s): %r", rid, wait_s, exc)
            return
        self._subscribe_failed.pop(rid, None)
        self._subscribed.add(rid)
        log.info("subscribed to KV events of %s at %s", rid, stats["kv_events_endpoint"])

    def _check_engine_config(self, rid: str, stats: dict) -> None:
        """Compare the block size and hash algorithm a replica's engine reports with this router's, once per
        replica, and warn when they differ. Why: the router hashes each request with its own; an engine that
        hashes otherwise publishes keys no request matches, and the replica is silently never found holding a
        prefix. Kept in `engine_config_mismatch` (/kvmesh/state)."""
        if "block_size" not in stats and "hash_algo" not in stats:
            return  # no routing stats yet: checked when they come
        self._config_checked.add(rid)
        ours = {"block_size": self.block_size, "hash_algo": self.hash_algo}
        differ = {
            k: {"engine": stats[k], "router": v}
            for k, v in ours.items()
            if stats.get(k) is not None and str(stats[k]) != str(v)
        }
        if not differ:
            return
        self.engine_config_mismatch[rid] = differ
        log.warning(
            "replica %s hashes KV blocks otherwise than this router (%s): no request will find its cached "
            "prefixes; configure the engines and the router alike",
            rid,
            ", ".join(f"{k} {d['engine']} there, {d['router']} here" for k, d in differ.items()),
        )

    def _may_subscribe(self, rid: str) -> bool:
        """Not while a failed subscription's back-off runs (each request would try again at once)."""
        failed = self._subscribe_failed.get(rid)
        return failed is None or time.monotonic() >= failed[1]

    def _forget(self, rid: str) -> None:
        """Drop everything routing keeps about a replica: its index slot (speculative entries included),
        its KV-event subscriber, its policy state and completed requests awaiting confirmation."""
        if rid in self._subscribed and self.events is not None:
            self._subscribed.discard(rid)
            asyncio.get_running_loop().create_task(self.events.remove_source(rid))
        for p in self._policies.values():  # also when the index forgot it first: no policy keeps its slot
            p.on_replica_removed(rid)
        self._config_checked.discard(rid)
        self.engine_config_mismatch.pop(rid, None)
        if not self.index.has_replica(rid):
            return
        node = self.index.node_of(rid)
        self.index.remove_replica(rid)
        if all(self.index.node_of(r) != node for r in self.index.replicas()):
            self.tiers.drop_node(node)  # no engine left on it: the node (or its last replica) is gone
            self.index.remove_node(node)
        self.peers.forget_replica(rid)
        self.load_reports.forget(rid)
        self._subscribe_failed.pop(rid, None)
        running = [(internal, st) for internal, st in self._inflight.items() if st.replica == rid]
        if running:  # calls to it still open once a stopped replica would have finished them never will
            ids = [  # each request's current call only: one that moved on keeps its id on its new replica
                st.info.request_id
                for internal, st in running
                if st.info.request_id
                and internal not in self._moved_off
                and self._by_request_id.get(st.info.request_id) == internal
            ]
            calls = local_state.OPEN_CALLS.calls(ids)  # these very calls: not a later one under the same id
            try:
                if calls:
                    asyncio.get_running_loop().call_later(self.abandon_left_after_s, self._abandon_left_on, rid, calls)
            except RuntimeError:  # not on a loop (a test's direct call): nothing of it is waiting
                pass
        local_state.LEDGER.forget_replica(rid)  # per-replica rows of /metrics and /kvmesh/state: not every id
        for serving in list(local_state.SERVING_METRICS):  # ever seen under autoscaling
            serving.forget_replica(rid)
        for internal, _ in running:
            self._complete(rid, internal)  # the replica is gone: what it was running ends with it
        for request_id in [k for k, st in self._unconfirmed.items() if st.replica == rid]:
            self._unconfirmed.pop(request_id).release()
        for internal in [k for k, st in self._held.items() if st.replica == rid]:
            self._drop_held(internal)
        self.forgotten += 1
        log.info("forgot replica %s", rid)

    def _abandon_left_on(self, rid: str, calls: dict[str, Any]) -> int:
        """`_forget`'s calls still open on `rid` `abandon_left_after_s` later: abandoned, each only if it is still the
        call that was open there (a request moved meanwhile was sent again under the same request id) and its
        request is not placed on another replica since (the ingress may have sent it again before the router
        heard of the loss). How many were abandoned."""
        left = {}
        for request_id, call in calls.items():
            _, st = self._current_call(request_id)
            if st is None or st.replica == rid:
                left[request_id] = call
        return local_state.OPEN_CALLS.abandon_calls(left)

    def replica_failed(self, rid: str) -> None:
        """A replica is dead (Serve said so, or the ingress saw it fail): forget it now and never choose it."""
        self._dead.add(rid)
        self._forget(rid)

    def replica_unavailable(self, rid: str) -> None:
        """The ingress saw a call to `rid` fail as unreachable (Ray's ActorUnavailableError: a blip or a death,
        Ray cannot tell): suspect, left out until it answers a probe, not forgotten as a dead one is. Only a
        replica this router routes to: another deployment's (its router is in this process too) is not probed
        here, so nothing would clear it."""
        if self._placeable(rid):
            self.watch.suspect_now(rid)

    def _add_replica(self, r: RunningReplica) -> None:
        """A new replica, cold: an empty index slot and fresh policy state (its events subscribe once its
        routing stats name the endpoint)."""
        rid = r.replica_id.unique_id
        self.index.add_replica(rid, node_id=str((r.routing_stats or {}).get("node_id") or r.node_id or "node-0"))
        for p in self._policies.values():
            p.on_replica_added(rid)

    def _subscribe_soon(self, replicas: list[RunningReplica]) -> None:
        """Subscribe to the KV events (and learn the LMCache tiers) of replicas that name their endpoint, in
        the background, so that a replica is ready (`_ready`) before the first request rather than during
        it. Otherwise the first requests after start-up, or after a scale-up, all go to the replicas that
        happened to be subscribed first (seen live: a fresh 2-replica app sent its first 15 requests, a
        whole burst of new conversations, to one replica)."""
        if self._loop is None or not self.subscribe_events:
            return
        if not any(self._unsubscribed(r) for r in replicas):
            self._sync_wanted = None  # an older list still waiting may name replicas that have left since
            return
        self._sync_wanted = replicas  # the latest list: a task already running takes it up when done
        if self._syncing is None or self._syncing.done():
            self._syncing = self._loop.create_task(self._sync_in_background())

    async def _sync_in_background(self) -> None:
        while self._sync_wanted is not None:
            replicas, self._sync_wanted = self._sync_wanted, None
            try:
                await self._sync_replicas(replicas)
            except Exception:  # the next request syncs again: this only failed to get ahead of it
                log.exception("background replica sync failed")

    def _live(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """Candidates minus replicas known dead; a replica whose engine reports itself broken joins them."""
        live = []
        for r in candidates:
            rid = r.replica_id.unique_id
            if rid not in self._dead and (r.routing_stats or {}).get("healthy", True) is False:
                log.warning("replica %s reports a broken engine: no longer routed to", rid)
                self.replica_failed(rid)
            if rid not in self._dead:
                live.append(r)
        return live

    def _ready(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """Candidates the router can see into: a replica added by Serve (autoscaling, restart) gets no
        traffic until its first routing stats arrived and its KV-event stream is subscribed, so what
        it caches is indexed from its first request on. Only when no replica is ready do all count."""
        ready = [r for r in candidates if self._is_ready(r)]
        if len(ready) < len(candidates):
            self.held_back += len(candidates) - len(ready)
        return ready or candidates

    def _answering(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """Candidates less the suspect replicas (all of them when every one is suspect). Left out, not ranked
        last: Serve sends to a replica blind while its cached queue length is fresh, and every send to it
        refreshes that entry, so a suspect replica ranked anywhere could still get requests that hang."""
        answering = self.watch.unsuspected(candidates)
        self.passed_over_suspect += len(candidates) - len(answering)
        return answering

    def _is_ready(self, r: RunningReplica) -> bool:
        return bool(r.routing_stats) and not self._unsubscribed(r)

    def _unsubscribed(self, r: RunningReplica) -> bool:
        """Does the replica name a KV-event stream this router should, and does not yet, subscribe to?"""
        return bool(
            self.subscribe_events
            and (r.routing_stats or {}).get("kv_events_endpoint")
            and r.replica_id.unique_id not in self._subscribed
        )

    def readiness(self) -> dict[str, int]:
        """Engine replicas Serve lists, and how many of them this router routes to with a full view
        (`_ready`): a replica's routing stats arrive up to one stats period after it runs, so an app that
        answers /health may still send its first requests to the replicas seen first."""
        listed = list(self.curr_replicas.values())
        return {"listed": len(listed), "ready": sum(1 for r in listed if self._is_ready(r))}

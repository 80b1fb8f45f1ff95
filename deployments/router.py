"""kvmesh's Ray Serve request router: place each request by KV-prefix residency and load.

Thin glue, by design (the logic lives in `policies/` and `cluster/`, testable without Ray):

1. hash the request's prompt tokens into vLLM block keys (`kvmesh.kvstore.hashing`, with the tenant salt),
2. look them up in an in-process `kvmesh.cluster.index.PrefixIndex` (no remote call on the request path),
3. build one `ReplicaView` per candidate (prefix per tier + load) and let the policy place the request
   (`FleetView.from_views`, then `policy.place`),
4. commit to the first choice at once (`_commit`: the policy's work and speculative index entries; a
   request held for a prefix gets its entries when the hold ends), before Serve places the request, so
   requests ranked meanwhile see it; moved if Serve places it elsewhere, withdrawn if it is cancelled.
   Once Serve has placed it, record the predicted cached tokens (checked against the engine's report,
   `kvmesh.deployments.prediction`).

The index is fed by one background task per engine replica subscribing to its vLLM KV-event stream
(`kvmesh.cluster.kv_events.KVEventSubscriber`; endpoint from the replica's `record_routing_stats`). Replicas
that leave are forgotten (index, subscriber, policy state; the membership steps: `router_membership.py`).
Replicas that stop answering Serve's queue-length probe (a frozen or cut-off node) are suspect
(`kvmesh.deployments.replica_watch`, a background task): left out of the ranking until they answer again,
nothing about them forgotten; their calls in flight are moved elsewhere once they have been suspect for some
seconds. No `FIFOMixin`: it would hand the chosen replica to whichever request is at the queue head, breaking
affinity under bursts. A prompt's samples (`n` > 1) share a key, and the later ones go where the first went
(`_samples_first`), as vLLM keeps a request's samples on one engine.

The router runs in the caller's process (the ingress replica), on that replica's own event loop
(`SERVE_PATH_ENV` sets RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0), which also owns the index and the
subscribers. Its state is not thread-safe, and `snapshot()`, `readiness()` and the rest read it where they are
called: other threads (the ingress's /metrics, /kvmesh/state and /health, through its `_on_router`) run them
on that loop with `call_on_loop`, and the ingress's notifications (`notify_first_token`,
`notify_request_ended`, ...) are posted there with `call_soon`.

Serve ships this class to that process by value (`RequestRouterConfig` pickles the router's module by
value, with the module-level objects its methods name): the process-wide objects the ingress shares
(the prediction ledger, the miss attribution) are reached through their modules at call time
(`local_state.LEDGER`, `miss_attribution.ATTRIBUTION`), never through a name bound at import, which
would arrive as a private copy.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvmesh.cluster.decision_trace import decision, ranking_cells
from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.tier_tracker import TierTracker
from kvmesh.deployments import local_state, miss_attribution
from kvmesh.deployments.load_report import LoadReports
from kvmesh.deployments.migration import origin_id
from kvmesh.deployments.peer_lag import is_free_choice
from kvmesh.deployments.prediction import predicted_cached_tokens
from kvmesh.deployments.recent import RecentSet
from kvmesh.deployments.replica_loss import ABANDON_AFTER_S, abandon_after_s
from kvmesh.deployments.replica_watch import ReplicaWatch
from kvmesh.deployments.router_hold import TierHolding
from kvmesh.deployments.router_membership import ReplicaMembership
from kvmesh.deployments.router_sync import PeerPlacements, RouterSync, held_message, routed_message
from kvmesh.deployments.serve_contract import check_serve_contract
from kvmesh.deployments.tier_hold import HoldSource, predicted_ttft_s
from kvmesh.kvstore.hashing import HashMemo, block_hashes
from kvmesh.policies.base import FleetView, ReplicaView, RequestInfo
from kvmesh.policies.registry import make_policy

if TYPE_CHECKING:
    from kvmesh.cluster.kv_events import KVEventSubscriber

log = logging.getLogger("ray.serve.kvmesh")  # Serve routes "ray.serve" logs to the replica log files
# placements /kvmesh/state keeps: a robustness draw's whole replay (at most 200 requests), and no more (the
# document grows ~0.5 KB per decision at 4 replicas)
DECISIONS_KEPT = 256
# request ids of ended requests kept to tell them in engines' load reports, which are a stats period old at
# most: far more than end in one
ENDED_IDS_KEPT = 4096
# How long after the ingress is done with a request Serve has to report its call complete, before the router
# ends the placement itself (`request_ended`): Serve's report is posted from another thread, and a call
# cancelled with its client is reported once the cancel reaches it.
REQUEST_END_GRACE_S = 10
# prompts whose samples (`n` > 1) are kept together, by the replica their last committed sample went to: far
# more than are ranked at once (a prompt's samples are ranked within moments of each other)
SAMPLE_GROUPS_KEPT = 4096


def _peer_computed(info: RequestInfo) -> None:
    """A request another ingress replica placed has its first token: its prompt counts as computed in this
    process's miss attribution (through the module: see above)."""
    if info.tenant is not None:
        miss_attribution.ATTRIBUTION.computed(info.tenant, info.block_hashes)


def active_routers() -> list[KvmeshRouter]:
    """Routers living in this process (normally one per engine handle in the ingress)."""
    return list(local_state.ROUTERS)


def request_fields(pending_request: PendingRequest | None) -> dict | None:
    """The engine request dict the ingress passed as the first positional argument, if any."""
    if pending_request is None or not pending_request.args:
        return None
    req = pending_request.args[0]
    if isinstance(req, dict) and isinstance(req.get("prompt_token_ids"), (list, tuple)):
        return req
    return None


class _Routing:
    """A request between ranking and placement: the router has committed to its first choice."""

    __slots__ = (
        "info",
        "matches",
        "policy",
        "views",
        "replica",
        "fresh",
        "held",
        "cells",
        "rankings",
        "ranked_at",
        "uncached",
        "samples_of",
    )

    def __init__(self, info: RequestInfo, matches: dict, policy, views: dict[str, ReplicaView], held: dict):
        self.info = info
        self.held = held  # the index's match before the LMCache chunk cut (`matches` is after it)
        self.matches = matches  # replica -> (hbm, host, shared) blocks of the request's prefix
        self.policy = policy
        self.views = views  # replica -> its view at ranking time
        self.replica = ""  # the replica the request is committed to
        self.fresh: list[tuple[int, int]] = []  # its claims on speculative marks there (given back if it moves)
        # for the decision trace: what ranking saw on the replicas it keeps (`decision_trace.replica_cells`),
        # how often the request was ranked, and when (router clock) it last was
        self.cells: dict[str, list] = {}
        self.rankings = 1
        self.ranked_at = time.monotonic()
        self.uncached = 0  # the prompt tokens it will compute on its replica (pending prefill there)
        self.samples_of: str | None = None  # the key its prompt's samples share (`n` > 1: fan_out.py)


class _Inflight(HoldSource):
    __slots__ = ("replica", "uncached", "first_token", "routing", "routed_at", "_ttft")

    def __init__(self, replica: str, uncached: int, routing: _Routing):
        super().__init__()
        self.replica = replica
        self.uncached = uncached
        self.first_token = False
        self.routing = routing  # the commitment, taken back if Serve retries the request elsewhere
        self.routed_at = time.monotonic()
        self._ttft: tuple[str, Any, float] | None = None  # `predicted_ttft_s` for (replica, view)

    def prefill_end_s(self, pace: float = 1.0) -> float:
        """When its prefill is predicted to end, from its policy's prediction when it was placed, at `pace`
        (`tier_hold.prefill_end_s`)."""
        return self.routed_at + pace * self.predicted_ttft_s()

    def predicted_ttft_s(self) -> float:
        """Its policy's predicted TTFT when it was placed (0 when the policy predicts nothing). Kept while its
        replica and that replica's view stay: the hold's pace (`TierHolding._pace`) reads it for every request
        waiting for its first token, at each ranking that weighs a prefix in flight."""
        view = self.routing.views.get(self.replica)
        kept = self._ttft
        if kept is None or kept[0] != self.replica or kept[1] is not view:
            predict = getattr(self.policy, "predict", None)
            kept = self._ttft = (self.replica, view, predicted_ttft_s(predict, self.info, view))
        return kept[2]

    @property
    def info(self) -> RequestInfo:
        return self.routing.info

    @property
    def policy(self):
        return self.routing.policy


class KvmeshRouter(TierHolding, ReplicaMembership, RequestRouter):
    """Prefix- and load-aware placement with a pluggable `policies` ranking."""

    dead_fleet_wait_s = 0.25  # how long a request waits before asking again while every listed replica is dead

    def initialize_state(
        self,
        policy: str = "kvmesh",
        policy_params: dict | None = None,
        hash_algo: str = "sha256",
        block_size: int = 32,
        speculative_ttl_s: float = 2.0,
        max_blocks: int = 2_000_000,
        mismatch_alarm_after: int = 3,
        seed: int = 0,
        subscribe_events: bool = True,
        router_sync: bool = True,
        probe_interval_s: float | None = None,
        probe_deadline_s: float | None = None,
        suspect_abandon_s: float | None = None,
        drain_timeout_s: float | None = None,
        **_ignored: Any,
    ):
        check_serve_contract()  # what follows relies on it: fail loudly, not with placement silently off
        self.policy = make_policy(policy, seed=seed, **(policy_params or {}))
        self.policy_name = policy
        self.seed = seed
        self._policies = {policy: self.policy}  # per-tenant overrides are built on first use
        self.hash_algo = hash_algo
        self.block_size = block_size
        # a replica Serve dropped: its calls still open this long after are given up (its drain time + margin)
        self.abandon_left_after_s = ABANDON_AFTER_S if drain_timeout_s is None else abandon_after_s(drain_timeout_s)
        # block_size: BlockStored events of another size are counted apart (`block_size_mismatch`), not applied
        self.index = PrefixIndex(max_blocks=max_blocks, speculative_ttl_s=speculative_ttl_s, block_size=block_size)
        # replica id -> {setting: {"engine": ..., "router": ...}} where its engine hashes KV blocks otherwise
        self.engine_config_mismatch: dict[str, dict[str, dict]] = {}
        self._config_checked: set[str] = set()
        self.tiers = TierTracker(self.index)  # LMCache host/shared residency (kvstore, docs/tiers.md)
        self.memo = HashMemo()
        self.subscribe_events = subscribe_events
        self.events: KVEventSubscriber | None = None  # created with the first source
        self._subscribed: set[str] = set()
        self._subscribing: set[str] = set()
        self._syncing: asyncio.Task | None = None  # `update_replicas`' background subscription, if running
        self._sync_wanted: list[RunningReplica] | None = None  # the replica list it is to sync next
        self._routing: dict[str, _Routing] = {}  # internal request id -> commitment, ranking to placement
        # a prompt's samples (`samples_of`) -> the replica the last of them was committed to (`_samples_first`)
        self._samples: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._inflight: dict[str, _Inflight] = {}  # internal request id -> state
        self._init_holds()  # held requests, the hold counters and the pace (router_hold.py)
        self._by_request_id: dict[str, str] = {}  # our request id -> internal request id (`_bind`)
        # the ingress's request id -> the ids of its continuations in `_by_request_id` (a stream continued on
        # another replica mid-answer: `migration.continuation_id`), which end with it (`_end_unreported`)
        self._continuations: dict[str, set[str]] = {}
        self._ended_ids = RecentSet(ENDED_IDS_KEPT)  # request ids ended lately (`_known_request`)
        # each replica's load report read against what the routers here know (`_views`); its readings are taken
        # anew when a request stops being known without having ended: a peer's dropped unheard, or one of ours
        # Serve routes again (`_retried`)
        self._unknown_again = 0
        self.load_reports = LoadReports(self._known_request, lambda: self.peers.dropped_unheard + self._unknown_again)
        # completed requests whose first token the ingress has not confirmed yet (request id -> state)
        self._unconfirmed: collections.OrderedDict[str, _Inflight] = collections.OrderedDict()
        # Serve's internal id -> request id of those waiting there: a replica's rejection may reach the router
        # as the cancelled call's completion before the retry is ranked
        self._completed: collections.OrderedDict[str, str] = collections.OrderedDict()
        # Serve's internal id -> replica of a rejected call whose completion is still to come (`_retried`):
        # that completion must not end the retry, which has the same internal id, on the same replica too
        self._rejected: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.request_end_grace_s: float = REQUEST_END_GRACE_S
        # placements Serve never reported complete, ended when the ingress was done with them (`request_ended`)
        self.unreported_ends = 0
        # replicas whose KV-event stream could not be subscribed: replica id -> (failures, next try, monotonic)
        self._subscribe_failed: dict[str, tuple[int, float]] = {}
        # requests ranked, and rankings of a request again (Serve found no free replica, or one refused it):
        # a saturated fleet is ranked many times per request, which per-request shares must not count
        self.decisions = 0
        self.rerankings = 0
        self.decision_s = 0.0  # every ranking's time
        # this router object's own name: its counters start at 0 with it, so a reader diffing two snapshots
        # (cachetest, across ingress replicas or a restart) must know both came from the same one
        self.instance = uuid.uuid4().hex[:12]
        # requests Serve sent elsewhere than the policy's first choice (its queue-length probe timed
        # out, or the replica was full): each one is a prefix the policy meant to reuse
        self.fallbacks = 0
        self.forgotten = 0  # replicas dropped from the index, subscribers and policies
        self.held_back = 0  # candidate replicas passed over because they were not ready yet (`_ready`)
        # replicas that stopped answering Serve's queue-length probe: left out of the ranking until they answer
        # (`_answering`); probed by a background task (`_start_watch`), the defaults in replica_watch.py
        self.watch = ReplicaWatch(
            interval_s=probe_interval_s,
            deadline_s=probe_deadline_s,
            progress=self._progress_of,
            abandon=self._move_calls_off,
            abandon_after_s=suspect_abandon_s,
            died=self.replica_failed,
        )
        # Serve's ids of calls given up on a suspect replica, until they end or are sent again: each given up once
        # (Serve sends a request's every call under one internal id, so the mark goes when the call is sent again)
        self._moved_off: set[str] = set()
        self._watching: asyncio.Task | None = None
        self.passed_over_suspect = 0  # candidate replicas left out of a ranking because they were suspect
        # replicas known dead (actor died, engine broken): never chosen again, even while Serve still lists them
        self._dead: set[str] = set()
        # the last placements, for /kvmesh/state's decision trace
        self.recent: collections.deque[dict] = collections.deque(maxlen=DECISIONS_KEPT)
        self._started = time.monotonic()
        # other ingress replicas' placements (router_sync.py): their load and speculative prefixes count here
        self.peers = PeerPlacements(
            self.index, lambda: self._policies.values(), tiers=self.tiers, on_computed=_peer_computed
        )
        self.router_sync = router_sync
        self.sync: RouterSync | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # Serve's router loop, seen in our own hooks
        self._watched: set[asyncio.Future] = set()  # PendingRequest futures whose outcome is awaited
        local_state.LEDGER.alarm_after = mismatch_alarm_after
        local_state.ROUTERS.add(self)

    def _start_sync(self) -> None:
        """Join the placement stream of the other ingress replicas' routers, once, from the router loop."""
        if self.sync is not None or not self.router_sync:
            return
        import ray

        try:
            asyncio.get_running_loop()  # called from the router's own hooks, which run on its loop
        except RuntimeError:
            return  # not on a loop yet: the first routing call starts it
        if not ray.is_initialized():
            return
        try:
            from ray import serve

            app = serve.get_replica_context().app_name
        except Exception:  # not in a Serve replica (tests): one registry per process is enough
            app = "local"
        self.sync = RouterSync(app, self.peers)
        self.sync.own_requests = lambda: [st.info.request_id for st in self._inflight.values() if st.info.request_id]
        try:
            self.sync.start()
        except Exception:
            log.exception("router sync failed to start: this router sees only its own placements")
            self.router_sync = False

    # ------------------------------------------------------------------ replica membership

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.replica_failed(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set: replicas that left are forgotten at once (not on the next request);
        new ones (a restarted replica has a new id) are added cold at once, without waiting for a request."""
        super().update_replicas(replicas)
        try:  # Serve calls this on the router's loop: the loop other threads hand work to (call_soon)
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass
        self._start_sync()
        self._start_watch()
        present = {r.replica_id.unique_id for r in replicas}
        for rid in set(self.index.replicas()) - present:
            self._forget(rid)
        self._dead &= present  # a dead id Serve no longer lists cannot come back
        known = set(self.index.replicas())
        for r in replicas:
            if r.replica_id.unique_id not in known | self._dead:
                self._add_replica(r)
        self._subscribe_soon([r for r in replicas if r.replica_id.unique_id not in self._dead])

    # ------------------------------------------------------------------ routing
    def _views(self, candidates: list[RunningReplica], matches: dict) -> list[ReplicaView]:
        pending: dict[str, list[int]] = {}
        # committed and not yet placed (Serve still probing queue lengths, or held for a prefix): queued on
        # its replica already, or a burst ranked during a probe sees every replica empty and piles onto the
        # one holding the burst's shared prefix
        for routing in self._routing.values():
            p = pending.setdefault(routing.replica, [0, 0, 0])  # inflight, started, pending prefill tokens
            p[0] += 1
            p[2] += routing.uncached
        waiting: dict[str, set[str]] = {}  # replica -> this router's requests sent there, no first token seen
        for st in self._inflight.values():
            p = pending.setdefault(st.replica, [0, 0, 0])
            p[0] += 1
            if st.first_token:
                p[1] += 1
            else:
                p[2] += st.uncached
                if st.info.request_id:
                    waiting.setdefault(st.replica, set()).add(st.info.request_id)
        for rid, (n, started, prefill) in self.peers.pending().items():
            p = pending.setdefault(rid, [0, 0, 0])
            p[0] += n
            p[1] += started
            p[2] += prefill
        views = []
        for r in candidates:
            rid = r.replica_id.unique_id
            stats = r.routing_stats or {}
            inflight, started, prefill = pending.get(rid, (0, 0, 0))
            queued, running = self.load_reports.load(rid, stats, inflight - started, started, waiting.get(rid, ()))
            hbm, host, shared = matches.get(rid, (0, 0, 0))
            views.append(
                ReplicaView(
                    replica_id=rid,
                    hbm_blocks=hbm,
                    host_blocks=host,
                    shared_blocks=shared,
                    queued=queued,
                    running=running,
                    kv_usage=float(stats.get("kv_usage", 0.0)),
                    pending_prefill_tokens=prefill,
                    capacity_blocks=int(stats.get("num_blocks", 0)),
                )
            )
        return views

    def _known_request(self, request_id) -> bool:
        """Whether a request an engine reports is one this router or a peer placed (in flight or ended
        lately), whose state they know better than a report up to a stats period old."""
        # (one ended before its first token came back is among the ended too: `_complete` adds every end, and
        # ENDED_IDS_KEPT ends outlast any report, which is a stats period old at most)
        return request_id in self._by_request_id or request_id in self._ended_ids or self.peers.knows(request_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        self._start_sync()
        self._start_watch()
        context = getattr(pending_request, "routing_context", None)
        if context is not None:
            # every answer ranks the whole fleet (less replicas left out on purpose, and again next time): when
            # Serve finds none of it free, it is to back off before asking again (25 ms doubling to 0.5 s, its
            # defaults), as after its own routers' full-fleet round, not re-rank the request in a tight loop
            context.should_backoff = True
        # one order for every router (by replica id), so routers with the same view break ties alike
        listed = len(candidate_replicas)
        candidate_replicas = sorted(self._live(candidate_replicas), key=lambda r: r.replica_id.unique_id)
        if listed and not candidate_replicas:
            # every replica Serve lists is known dead (a lone replica whose engine broke, before Serve's health
            # check replaces it): Serve asks again at once when the answer is empty, so wait here, or that
            # retry loop never yields and the replacement's arrival is never processed
            await asyncio.sleep(self.dead_fleet_wait_s)
        await self._sync_replicas(candidate_replicas)
        # suspect ones out first: a ready replica that froze must not win over an answering one not ready yet
        candidate_replicas = self._ready(self._answering(candidate_replicas))
        req = request_fields(pending_request)
        # not an engine request (e.g. info()): any replica
        if req is None or pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        ids = req["prompt_token_ids"]
        # a request for its prompt's log-probabilities reads no cache (vLLM computes the whole prompt for them):
        # nothing to match, nothing to predict, placed by load
        reads_cache = (req.get("params") or {}).get("prompt_logprobs") is None
        hashes = (
            block_hashes(ids, self.block_size, algo=self.hash_algo, cache_salt=req.get("cache_salt"), memo=self.memo)
            if reads_cache
            else []
        )
        info = RequestInfo(
            block_hashes=hashes,
            num_tokens=len(ids),
            block_size=self.block_size,
            expected_output_tokens=int((req.get("params") or {}).get("max_tokens") or 0),
            tenant=req.get("tenant"),
            request_id=req.get("request_id"),
        )
        internal = pending_request.metadata.internal_request_id
        self._loop = asyncio.get_running_loop()
        # ranked before: its replica rejected it (placed, or its completion first), or Serve found none free
        again = internal in self._inflight or internal in self._completed or internal in self._routing
        if internal in self._inflight:  # Serve routes it again: the replica it was placed on rejected it
            self._retried(pending_request)
        elif internal in self._completed:  # the same, the rejected call's completion having come first
            self._retried_after_completion(internal)
        earlier = self._routing.pop(internal, None)
        if earlier is not None:  # ranked again (Serve found no free replica): take the first try back
            self._withdraw(earlier)
            self._drop_held(internal)
        if self.sync is not None:
            self.sync.drain()  # peers' placements already received count in this ranking
        held = self.index.match(hashes)
        matches = self.tiers.loadable(held)  # tier rows in whole LMCache chunks
        policy = self._policy_for(req)
        views = self._views(candidate_replicas, matches)
        fleet = FleetView.from_views(views)
        # peers' placements not heard of yet: the policy spreads new prefixes over where they may have gone
        fleet.unseen_placements, fleet.unseen_tokens = self.peers.unseen_placements()
        known = None
        may_hold = True
        by_view = {v.replica_id: v for v in views}
        if (self._inflight or self._held or self.peers.placements) and self.tiers.any_node():
            # with holds taking their share of Serve's routing tasks (`_may_hold`), the request is ranked and
            # committed as one that will not be held: credited only prefixes it will find stored
            may_hold = self._may_hold(listed)
            known = self._add_inflight(info, fleet, may_hold, policy, by_view)
        order = policy.place(info, fleet)
        ranked = [fleet.ids[k] for k in order]
        samples_of = req.get("samples_of") if isinstance(req.get("samples_of"), str) else None
        together = self._samples_first(samples_of, ranked)
        if together is not None:  # where the prompt's first sample went: computed once there, as vLLM's n is
            ranked = together
        # a sample following another is held for nothing: the engine batches it with the one it follows
        plan = (
            self._plan_hold(info, matches, by_view, ranked[0], policy, known, may_hold)
            if ranked and together is None
            else None
        )
        hold = plan if plan is not None and plan.held else None
        # Commit to the first choice now, before any hold: Serve may still await a queue-length probe before
        # it places this request, and requests ranked meanwhile must see it (its work; its prefix once it is
        # sent), or a burst of cold requests, or a group's members held for the same prefix, all pick the same
        # replica.
        routing = _Routing(info, matches, policy, by_view, held)
        routing.samples_of = samples_of
        routing.cells = ranking_cells(policy, fleet, order[0] if together is None else fleet.ids.index(ranked[0]))
        if earlier is not None:
            routing.rankings += earlier.rankings
        self._commit(routing, ranked[0], announce=hold is None)
        self._routing[internal] = routing
        if plan is not None and not plan.held:  # taken back should its source never store the prefix
            self._credit_unheld(plan, internal, routing)
        self._watch(pending_request)
        if len(self._routing) > 10_000:  # requests cancelled while waiting for a replica never get routed
            oldest = next(iter(self._routing))
            self._withdraw(self._routing.pop(oldest))
            self._drop_held(oldest)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if again:
            self.rerankings += 1
        else:
            self.decisions += 1
        self.decision_s += time.perf_counter() - t0
        if hold is not None:
            # its own prefill is a source too, from when it is predicted to be sent
            self._held[internal] = held_source = _Inflight(ranked[0], routing.uncached, routing)
            held_source.routed_at += hold.wait_s
            await self._hold(routing, internal, hold.src, hold.before, held_source)
            if self._routing.get(internal) is routing and not self._placeable(routing.replica):
                return []  # its replica died or left during the hold: Serve asks again, and it is ranked anew
            # a replica may have died, left or become suspect during the hold: Serve would send to it blind
            ranked = [rid for rid in ranked if self._placeable(rid)]
            ranked = [rid for rid in ranked if rid not in self.watch.suspect] or ranked
        return [[by_id[rid]] for rid in ranked if rid in by_id]

    def _samples_first(self, samples_of: str | None, ranked: list[str]) -> list[str] | None:
        """`ranked` with the replica another sample of the same prompt was committed to put first, the others
        after it in the policy's order (Serve tries them should it be full); None when there is none among them
        (the prompt's first sample, or its replica no longer a candidate). vLLM keeps a request's `n` samples
        on one engine, which computes the prompt once for all of them; the policy, ranking each sample as a
        request of its own, may send a later one elsewhere to balance the first one's prefill, and there it
        would be computed again."""
        rid = self._samples.get(samples_of) if samples_of is not None else None
        if rid is None or rid not in ranked:
            return None
        return [rid, *(r for r in ranked if r != rid)]

    def _placeable(self, rid: str) -> bool:
        """Not dead, nor forgotten since it was ranked (it left Serve's list): Serve may be given it."""
        return rid not in self._dead and self.index.has_replica(rid)

    def _commit(self, routing: _Routing, rid: str, announce: bool = True) -> None:
        """Count the request as routed to `rid`: the policy's work at once and, with `announce`, its
        speculative prefix and its placement message (`_announce`). A held request is announced only when its
        hold ends: until it is sent, its replica does not have its prefix, and a request sent there
        meanwhile on the strength of that prefix would compute it. Its tenant's peers hear of it at once
        (`held`): admitted, it counts towards the tenant's fleet-wide limits while it waits."""
        routing.replica = rid
        if routing.samples_of is not None:  # the prompt's other samples follow it here
            self._samples[routing.samples_of] = rid
            self._samples.move_to_end(routing.samples_of)
            if len(self._samples) > SAMPLE_GROUPS_KEPT:
                self._samples.popitem(last=False)
        hbm, _, shared = routing.matches.get(rid, (0, 0, 0))
        info = routing.info
        routing.uncached = info.num_tokens - predicted_cached_tokens(hbm, shared, info.num_tokens, info.block_size)
        if self.index.has_replica(rid):  # not one forgotten since it was ranked: the policy would keep it for good
            routing.policy.on_routed(routing.info, rid, routing.views.get(rid))
        routing.fresh = []
        if announce:
            self._announce(routing)
        elif self.sync is not None and info.request_id and info.tenant is not None:
            self.sync.publish(held_message(self.sync.router_id, info))

    def _announce(self, routing: _Routing) -> None:
        """The committed request's prefix goes into the index, speculatively, on its replica, and (with
        several ingress replicas) its placement to the other routers."""
        rid = routing.replica
        if self.index.has_replica(rid):
            self.index.speculate(rid, routing.info.block_hashes, fresh=routing.fresh)
        if self.sync is not None and routing.info.request_id:
            matched = routing.matches.get(rid, (0, 0, 0))
            free = is_free_choice([v.shared_blocks for v in routing.views.values()])
            self.sync.publish(routed_message(self.sync.router_id, routing.info, rid, matched, free=free))

    def _withdraw(self, routing: _Routing, publish: bool = True) -> None:
        """Undo `_commit` for a request that went elsewhere, is ranked again, or was cancelled. Without
        `publish`, the peers are not told: a held request committed again at once, whose `routed` replaces
        its `held` there (an `unrouted` first would let its tenant's count dip meanwhile)."""
        routing.policy.on_unrouted(routing.info, routing.replica)
        if routing.fresh:
            self.index.withdraw(routing.replica, routing.fresh)
        routing.fresh = []
        if publish:
            self._publish("unrouted", routing.info.request_id, routing.replica)

    def _publish(self, kind: str, request_id: str | None, replica: str = "") -> None:
        if self.sync is not None and request_id:
            self.sync.publish([kind, self.sync.router_id, request_id, replica])

    def _watch(self, pending_request: PendingRequest) -> None:
        """Learn where Serve placed the request, or that its caller gave up, from the request's own future:
        Serve resolves `PendingRequest.future` with the chosen replica, cancels it when the caller goes
        away, and gives a retried request a fresh one (deployments/serve_contract.py checks all three).
        Serve's `on_request_routed` would come only after the replica accepted, and not at all without
        the rejection protocol."""
        fut = getattr(pending_request, "future", None)
        if fut is None or fut in self._watched:
            return
        self._watched.add(fut)
        fut.add_done_callback(lambda done: self._settled(pending_request, done))

    def _settled(self, pending_request: PendingRequest, fut: asyncio.Future) -> None:
        self._watched.discard(fut)
        if fut.cancelled() or fut.exception() is not None:  # no replica for it (client gone): undo the commitment
            gone = self._routing.pop(pending_request.metadata.internal_request_id, None)
            if gone is not None:
                self._withdraw(gone)
            self._drop_held(pending_request.metadata.internal_request_id)
            return
        self._routed(pending_request, fut.result().replica_id)

    def _retried(self, pending_request: PendingRequest) -> None:
        """Serve routes a request again after its replica rejected it: the first placement's policy
        credit and speculative blocks are taken back before it is ranked anew."""
        internal = pending_request.metadata.internal_request_id
        earlier = self._inflight.pop(internal, None)
        self._moved_off.discard(internal)  # the mark was the earlier call's: Serve sends again under the same id
        if earlier is not None:
            self._rejected[internal] = earlier.replica  # its completion comes later: not the retry's
            while len(self._rejected) > 1024:
                self._rejected.popitem(last=False)
            earlier.release()
            if earlier.info.request_id:
                self._unbind(earlier.info.request_id)
                self._unknown_again += 1
            self._withdraw(earlier.routing)

    def _retried_after_completion(self, internal: str) -> None:
        """`_retried` for a request whose rejected call Serve reported complete first: it waits among the
        unconfirmed, and its placement's credit and speculative blocks are taken back from there."""
        request_id = self._completed.pop(internal)
        earlier = self._unconfirmed.pop(request_id, None)
        if earlier is not None:
            earlier.release()
            self._withdraw(earlier.routing)

    def _policy_for(self, req: dict):
        """The request's policy: the default, or the one the ingress set for its tenant (`policy`)."""
        name = req.get("policy")
        if not name or name == self.policy_name:
            return self.policy
        if name not in self._policies:
            policy = make_policy(name, seed=self.seed)
            for rid in self.index.replicas():
                policy.on_replica_added(rid)
            self._policies[name] = policy
        return self._policies[name]

    def _routed(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        internal = pending_request.metadata.internal_request_id
        routed = self._routing.pop(internal, None)
        if routed is None:
            return
        info, matches, first = routed.info, routed.matches, routed.replica
        rid = replica_id.unique_id
        if rid != first:  # Serve placed it elsewhere (probe timeout, full replica): move the commitment
            self.fallbacks += 1
            self._withdraw(routed)
            self._commit(routed, rid)
        self.recent.append(
            decision(
                info.request_id,
                rid,
                routed.cells,
                t_s=round(routed.ranked_at - self._started, 4),
                first_choice=first,
                rankings=routed.rankings,
                held=internal in self._held,  # held for a prefix another replica was computing
                tokens=info.num_tokens,
                # the replicas the decision keeps (a large fleet's trace stays small), not every prefix holder
                cached_blocks={
                    r: m[2] for r, m in matches.items() if m[2] and (r in routed.cells or r in (rid, first))
                },
                chosen_tiers=list(matches.get(rid, (0, 0, 0))),  # prefix blocks in (hbm, +host, +shared)
            )
        )
        predicted = info.num_tokens - routed.uncached  # committed to rid: `_commit` worked it out
        miss_attribution.ATTRIBUTION.placed(
            info.request_id,
            rid,
            first,
            matches,
            info.block_hashes,
            info.block_size,
            routed.views,
            tier_blocks=self._tier_blocks(routed.held),
            tenant=info.tenant,
        )
        st = self._held.pop(internal, None)  # held first: requests may be waiting for it already
        if st is None:
            st = _Inflight(rid, routed.uncached, routed)
        else:  # sent now, perhaps elsewhere than Serve was asked first
            st.replica, st.uncached, st.routed_at = rid, routed.uncached, time.monotonic()
        self._inflight[internal] = st
        if info.request_id:
            self._bind(info.request_id, internal)
            local_state.LEDGER.predict(info.request_id, rid, predicted, info.block_size)

    def _tier_blocks(self, held: dict) -> int:
        """The longest prefix any replica could reach in a tier, were there no chunk cut (0 without LMCache):
        for miss attribution, once per placed request rather than at every ranking."""
        if not self.tiers.any_node():
            return 0
        return max((m[2] for m in self.tiers.loadable(held, whole_chunks=False).values()), default=0)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Serve calls this for every request, failed and cancelled ones included, and says nothing of the
        # outcome: only a request whose first token came back has a prefill that LMCache stored.
        # A unary request's first token reaches the router after its completion (the ingress learns of it
        # from the whole response), so requests waiting for its prefix are released by the confirmation (or
        # their timeout), not here: released now, they would not count the prefix it stored.
        rid = replica_id.unique_id
        if self._rejected.get(internal_request_id) == rid:  # a rejected call's: the retry may be on rid too
            del self._rejected[internal_request_id]
            return
        self._complete(rid, internal_request_id)

    def _complete(self, rid: str, internal_request_id: str) -> None:
        st = self._inflight.get(internal_request_id)
        if st is None or st.replica != rid:  # not an earlier attempt's, rejected by its replica
            return  # (Serve cancels that call and may say so after the retry was placed elsewhere)
        del self._inflight[internal_request_id]
        self._moved_off.discard(internal_request_id)
        request_id = st.info.request_id
        if request_id is None or self._by_request_id.get(request_id) != internal_request_id:
            st.release()  # a migrated request's earlier call: its new call, under the same request id, goes on
            return
        self._publish("done", request_id, st.replica)
        self._unbind(request_id)
        self._ended_ids.add(request_id)  # a load report made before it ended still names it
        if st.first_token:
            self._record_prefill(st)
        else:  # its first token may still be on its way from the ingress
            self._unconfirmed[request_id] = st
            self._completed[internal_request_id] = request_id
            while len(self._unconfirmed) > 1024:  # failed or cancelled before a token: never confirmed
                self._unconfirmed.popitem(last=False)[1].release()
            while len(self._completed) > 1024:
                self._completed.popitem(last=False)

    def request_ended(self, request_id: str) -> None:
        """The ingress is done with the request (answered, failed, or its client gone). Serve reports every
        call it sent complete, but not one whose caller was cancelled after Serve gave it a replica and
        before it sent: that placement would count as its replica's load, and to the other routers as its
        tenant's request in flight, for good. What Serve has not reported a grace period later ends here: the
        request's call, and those of its continuations (moved mid-stream, each under an id of its own)."""
        if self._loop is not None:
            self._loop.call_later(self.request_end_grace_s, self._end_unreported, request_id)

    def _current_call(self, request_id: str) -> tuple[str | None, _Inflight | None]:
        """(Serve's internal id, in-flight state) of the request's latest call, or Nones."""
        internal = self._by_request_id.get(request_id)
        return internal, (self._inflight.get(internal) if internal else None)

    def _end_unreported(self, request_id: str) -> None:
        """End what Serve has not reported complete of the request: its call, and its continuations' (the
        ingress names only the request it admitted)."""
        for rid in [request_id, *sorted(self._continuations.get(request_id, ()))]:
            internal, st = self._current_call(rid)
            if internal is not None and st is not None:
                self.unreported_ends += 1
                self._complete(st.replica, internal)

    def _bind(self, request_id: str, internal: str) -> None:
        """The request's latest call is Serve's `internal` (`_current_call`)."""
        self._by_request_id[request_id] = internal
        origin = origin_id(request_id)
        if origin != request_id:
            self._continuations.setdefault(origin, set()).add(request_id)

    def _unbind(self, request_id: str) -> None:
        self._by_request_id.pop(request_id, None)
        origin = origin_id(request_id)
        moved = self._continuations.get(origin) if origin != request_id else None
        if moved is not None:
            moved.discard(request_id)
            if not moved:
                del self._continuations[origin]

    def _record_prefill(self, st: _Inflight) -> None:
        if self.index.has_replica(st.replica):  # its prompt's full chunks are now in L1 (and L2)
            self.tiers.record_prefill(st.replica, st.info.block_hashes)

    def first_token(self, request_id: str) -> None:
        """The ingress saw the first token: the request's prefill is no longer pending work."""
        _, st = self._current_call(request_id)
        if st is not None:
            st.first_token = True
            st.release()
            self._publish("started", request_id, st.replica)
            if self.tiers.any_node():  # only holds read the pace
                self.prefill_pace.observe(time.monotonic() - st.routed_at, st.predicted_ttft_s())
            return
        done = self._unconfirmed.pop(request_id, None)
        if done is not None:  # the request completed before the ingress's word arrived
            done.first_token = True
            done.release()
            if self.tiers.any_node():  # after its "done": with LMCache, peers record its prefill in the tiers
                self._publish("started", request_id, done.replica)
            self._record_prefill(done)

    # ------------------------------------------------------------------ observability
    def snapshot(self) -> dict:
        return {
            "instance": self.instance,
            "policy": self.policy_name,
            "replicas": self.index.replicas(),
            "index": dict(self.index.stats),
            "engine_config_mismatch": dict(self.engine_config_mismatch),
            "tiers": dict(self.tiers.counters),
            "subscribers": sorted(self._subscribed),
            "events": self.events.stats() if self.events is not None else {},
            "decisions": self.decisions,
            "rerankings": self.rerankings,
            "decision_s_total": self.decision_s,
            "fallbacks": self.fallbacks,
            "forgotten": self.forgotten,
            "unreported_ends": self.unreported_ends,
            "held_back": self.held_back,
            "suspect": sorted(self.watch.suspect),
            "suspicions": self.watch.suspicions,
            "passed_over_suspect": self.passed_over_suspect,
            "probes": self.watch.stats(),
            "held_for_tier": self.held_for_tier,
            "hold_timeouts": self.hold_timeouts,
            "holding": self.holding,  # held now, each in one of Serve's routing tasks
            "holds_full": self.holds_full,  # rankings that could not hold: every hold slot taken (`_may_hold`)
            "prefill_pace": self.prefill_pace.value,
            "tier_nodes": self.tiers.nodes(),
            "tier_nodes_unanswering": self.tiers.unanswering_nodes(),  # their host-tier model kept aside
            "recent_decisions": self.recent_decisions(),
            "inflight": len(self._inflight),
            "sync": self.sync.stats() if self.sync is not None else None,
            "routing_stats": {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in self.curr_replicas.values()},
        }

    def recent_decisions(self) -> list[dict]:
        """The last placements, oldest first, as `decision_trace.decision` records (what ranking saw per
        replica, re-rankings, holds), for comparing with the simulator's."""
        return list(self.recent)

    def cache_reset(self, rid: str) -> None:
        """The replica's engine dropped its prefix cache: forget what it held now (its AllBlocksCleared
        event is published only with the engine's next step, after the next request was routed)."""
        if self.index.has_replica(rid):
            self.index.clear(rid, "hbm")

    def held_blocks(self) -> dict[str, int]:
        return {rid: self.index.held_blocks(rid) for rid in self.index.replicas()}

    def call_soon(self, fn, *args) -> None:
        """Run fn(*args) on the router's loop, from any thread; dropped when the router has not routed yet
        (nothing of it can be in flight) or its loop is closed."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed
                pass

    def call_on_loop(self, fn, timeout: float = 5.0):
        """Run fn() on the router's event loop from another thread (the index is not thread-safe)."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:  # not routing yet: nothing runs on a loop of its own
            return fn()

        async def _call():
            return fn()

        return asyncio.run_coroutine_threadsafe(_call(), loop).result(timeout)


def notify_replica_failed(replica_id: str) -> None:
    """The ingress saw `replica_id` fail a request: every router in this process stops choosing it."""
    for r in active_routers():
        r.call_soon(r.replica_failed, replica_id)


def notify_replica_unavailable(replica_id: str) -> None:
    """The ingress saw a call to `replica_id` fail as unreachable: every router in this process holds it
    suspect until it answers a probe."""
    for r in active_routers():
        r.call_soon(r.replica_unavailable, replica_id)


def notify_cache_reset(replica_ids: list[str]) -> None:
    """These replicas' engines dropped their prefix caches: every router in this process forgets what they
    held before this returns (called from a thread other than the routers' loop)."""
    for r in active_routers():
        r.call_on_loop(lambda r=r: [r.cache_reset(rid) for rid in replica_ids])


def notify_first_token(request_id: str) -> None:
    for r in active_routers():
        r.call_soon(r.first_token, request_id)


def notify_request_ended(request_id: str) -> None:
    for r in active_routers():
        r.call_soon(r.request_ended, request_id)

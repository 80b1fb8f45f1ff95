"""One placement view across ingress replicas: every router publishes its placements, every other router
applies them.

Why: each ingress replica runs its own router, with its own prefix index, speculative entries, load view
and balance guard. Alone, two routers put the same new prefix on two replicas, and each balances only the
work it sent itself (with two ingress replicas on four engines, one replica got every prefill). Dynamo
keeps its router replicas' active blocks in step by publishing each routing decision; kvmesh does the
same: a router's commitment (replica, block hashes, predicted prefill work) goes out on a ZMQ PUB socket
the moment it is made, and each peer credits it to the same replica, in its index (speculative blocks,
TTL-bounded until the engine's BlockStored confirms them), its policies (balance guard, fanout) and its
in-flight load, and takes it back when the placement is moved, the first token arrives or it completes.

Nothing here is on the request path: publishing is a non-blocking send; peers' messages are applied by a
background task on the router's own event loop; peers are found by a background poll of a small named
registry actor. Messages carry block hashes and counts, never token ids or text. Between nodes the stream
is CURVE-encrypted with the deployment's channel keys (`kvmesh.cluster.secure_channel`); without keys it
binds to loopback only, so it never crosses a network in the clear.

Each `routed` message carries the wall-clock time it was made, and whether the placing router was free to
choose the replica (`is_free_choice`): a peer's placements reach this router one lag late, so the peers'
placements of the last lag are unknown here. `UnseenPlacements` counts the free ones (rate times lag)
for the policy, which spreads new prefixes over where they may have gone instead of ranking them onto the
replica every router's stale view puts first (`KvmeshPolicy._unseen_pick`). The simulator
(`kvmesh.cluster.multi_router`) counts them with the same class. The stamp is the peer's clock and the
arrival this router's: on two hosts a few ms of skew would be taken for lag, so each peer's clock offset
is estimated from the two one-way streams (`PeerClocks`, fed by `clock` messages) and taken off.

`PeerPlacements` is the state and its rules (pure, tested without sockets); `RouterSync` is the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.deployments.migration import origin_id
from kvmesh.deployments.peer_lag import CLOCK_STEP_S, UnseenPlacements
from kvmesh.deployments.recent import RecentSet
from kvmesh.deployments.tenant_usage import PeerTenantUsage
from kvmesh.deployments.tier_hold import HoldSource, prefill_end_s
from kvmesh.policies.base import ReplicaView, RequestInfo

log = logging.getLogger("ray.serve.kvmesh")

REGISTRY_NAMESPACE = "kvmesh"
REGISTRY_NAME = "router-registry-{app}"  # one detached registry actor per app (`kvmesh.deployments.app` ends it)
PEER_TTL_S = 15.0  # a router that stopped refreshing its registry entry this long ago is gone
PLACEMENT_TTL_S = 120.0  # a peer placement not heard of for this long (lost `done`, peer died) stops counting
LEFT_IDS_KEPT = 4096  # request ids of peer placements that left lately, told apart in engines' load reports
LIVE_EVERY_S = PLACEMENT_TTL_S / 4  # how often a router names its requests still in flight (`live`)
REGISTRY_TIMEOUT_S = 3.0  # a registry heartbeat unanswered this long is given up (its node frozen or cut off)
# The stream's queues are bounded in bytes, not only in frames: a peer that is frozen (SIGSTOP, a paused VM)
# keeps its TCP connection open, and the PUB socket queues every frame for it up to its high-water mark. A
# frame is at most FRAME_MAX_BYTES (`flush` splits a turn's batch there); one message alone exceeds it only
# for a `routed` of a prompt over ~230k tokens at 16-token blocks (9 bytes a block hash). So a frozen peer
# costs at most STREAM_HWM x FRAME_MAX_BYTES = 62.5 MiB queued, within STREAM_QUEUE_BUDGET_BYTES, on each
# side, and ZMQ's heartbeats close its connection after STREAM_HEARTBEAT_TIMEOUT_MS, freeing it (frames
# dropped meanwhile are lost messages, as any: placements expire, `live` renews the running ones).
FRAME_MAX_BYTES = 128 * 1024
STREAM_HWM = 500  # frames; a frame is one turn of a router's loop (`batch_on`), so seconds of a busy router
STREAM_QUEUE_BUDGET_BYTES = 64 * 1024 * 1024
STREAM_HEARTBEAT_IVL_MS = 2_000  # ZMTP PING every 2 s on an idle connection
STREAM_HEARTBEAT_TIMEOUT_MS = 10_000  # no traffic or PONG for 10 s: the connection is closed (SUB reconnects)


@dataclass
class PeerPlacement(HoldSource):
    """One request another router placed: what this router credited for it, to take back later.

    It is also a source a request of this router may wait for (`KvmeshRouter._plan_hold`), with
    the same interface as the router's own in-flight requests: `first_token`, `prefill_left_s()`, `prefill_end_s()`,
    `released()`. Its prefill is predicted from the replica as the peer ranked it (`view`), by `predict`
    (a policy's), only when a request considers waiting for it."""

    replica: str
    info: RequestInfo
    uncached: int
    fresh: list[tuple[int, int]] = field(default_factory=list)  # its claims on speculative marks (index.speculate)
    started: bool = False
    at: float = field(default_factory=time.monotonic)
    seen: float = field(default_factory=time.monotonic)  # last heard of as in flight (`expire`)
    view: ReplicaView | None = None
    predict: Any = None

    def __post_init__(self) -> None:
        HoldSource.__init__(self)

    @property
    def first_token(self) -> bool:
        return self.started

    def prefill_end_s(self, pace: float = 1.0) -> float:
        """When its prefill is predicted to end, counted from when this router heard of it, at `pace`
        (`tier_hold.prefill_end_s`)."""
        return prefill_end_s(self.at, self.predict, self.info, self.view, pace)


@dataclass
class HeldRequest:
    """A peer's request that counts for its tenant and credits no replica and no prefix: one it committed and
    holds for a prefix another replica is computing (`held`), not sent yet, until its `routed`; or one
    running on a replica this router forgot, which may still be finishing it (`forget_replica`)."""

    tenant: str
    num_tokens: int
    seen: float  # last heard of (`expire`, `live`)


class PeerPlacements:
    """Other routers' in-flight placements, applied to this router's index and policies.

    `policies` is a callable returning the router's live policy objects (tenants may add some later).
    `clock` is the wall clock peers stamp their placements with (`routed_message`), used only for what is
    compared with a peer's stamp (lags, clock offsets): what ages (`expire`, the unseen window) counts on
    `monotonic`, which a step of the wall clock leaves alone. With `tiers` (the router's TierTracker), a
    peer's request that completed after its first token counts in its node's LMCache tiers, as the
    router's own do: LMCache stored its prompt whichever router placed it. `tenants`
    collects what peers placed per tenant, for fleet-wide tenant limits (default: a new log on the
    monotonic clock). `on_computed(info)` is called once per peer request whose first token came back: its
    prompt has been computed, wherever it was placed (the router's miss attribution counts it as seen)."""

    def __init__(
        self,
        index,
        policies,
        clock=time.time,
        tiers=None,
        tenants: PeerTenantUsage | None = None,
        on_computed=None,
    ) -> None:
        self.index = index
        self.on_computed = on_computed
        self.tiers = tiers  # a TierTracker: a peer's completed prefill is in its node's LMCache tiers
        # placements whose `done` came before their `started` (a unary request's first token reaches its
        # router after the completion): the `started` still records the prefill and releases waiters
        self.ended: OrderedDict[tuple[str, str], PeerPlacement] = OrderedDict()
        self.policies = policies
        self.placements: dict[tuple[str, str], PeerPlacement] = {}
        # per replica, [in flight, started, pending prefill tokens] of `placements`, kept as they change:
        # `pending()` is read for every ranking, and walking every peer placement there cost ms per request
        self._totals: dict[str, list[int]] = {}
        # per peer router, when its last message arrived (`monotonic`): a peer whose stream still arrives is
        # not dropped because the registry forgot it (`RouterSync._follow`)
        self.heard_from: dict[str, float] = {}
        # per tenant, what peers placed (`tenant_usage.PeerTenantUsage`): fleet-wide tenant limits read it
        self.tenants = tenants if tenants is not None else PeerTenantUsage()
        self._counted = RecentSet(65_536)  # requests already logged there (far more than are routed again over)
        # per request, (router, request id it continues: `migration.origin_id`) -> [tenant, its placements and
        # held claims tracked here]: one request in flight for its tenant however many calls it is heard as
        self._requests: dict[tuple[str, str], list] = {}
        # peers' requests counted for their tenant only (`HeldRequest`): held for a prefix in flight (`held`)
        # until their `routed`, or running on a replica this router forgot until their `done`
        self.held: dict[tuple[str, str], HeldRequest] = {}
        # request ids of the placements in flight (how many under each), and of those that left lately
        self._in_flight_ids: dict[str, int] = {}
        self._left_ids = RecentSet(LEFT_IDS_KEPT)
        # placements dropped unheard (`_pop`): each makes a request id it knew of unknown while it may still run
        self.dropped_unheard = 0
        self.applied = 0
        self.clock = clock
        self.monotonic = time.monotonic  # what a placement's `seen`, `expire` and the unseen window count in
        self.unseen = UnseenPlacements()
        self.router_id: str | None = None  # this router's (`RouterSync.open`): its entry in a peer's `clock` message

    def clock_message(self, router: str) -> list:
        """What `router` (this one) publishes every poll for its peers' clock offsets (`PeerClocks`):
        ["clock", router, "", "", sent_at, {peer: least one-way time observed from it lately (s)}, epoch,
        {peer: that peer's epoch the least was observed under}] (`epoch`: how often this router's wall clock
        was stepped, `PeerClocks.own_clock`; a peer of an older version sends neither)."""
        before = self.monotonic()
        now = self.clock()
        after = self.monotonic()
        clocks = self.unseen.clocks
        if after - before < CLOCK_STEP_S / 10:  # read together: a pause between the reads is no step
            clocks.own_clock(now, (before + after) / 2)
        least = clocks.minimums(now)
        return ["clock", router, "", "", now, least, clocks.epoch, clocks.epochs(least)]

    def _count_tenant(self, key: tuple[str, str], tenant: str | None, num_tokens: int, delta: int) -> None:
        """A peer's placement or held claim `key` of `tenant` starts (+1) or stops (-1) being tracked. Its request
        is in flight for the tenant while any of its calls is (a continuation of a migrated stream is the same
        request: `migration.origin_id`), and logged as placed once, at its first call: a request routed again,
        held then sent, moved between replicas or continued on another is one request."""
        if tenant is None:
            return
        request = (key[0], origin_id(key[1]))
        entry = self._requests.get(request)
        if delta > 0:
            if entry is None:
                self._requests[request] = [tenant, 1]
                self.tenants.in_flight(tenant, +1)
            else:
                entry[1] += 1
            if request == key and key not in self._counted:  # a continuation was admitted as its original
                self._counted.add(key)
                self.tenants.placed(tenant, num_tokens)
        elif entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._requests[request]
                self.tenants.in_flight(entry[0], -1)

    def _unhold(self, key: tuple[str, str]) -> None:
        """A held request was sent (its `routed` counts it now), cancelled, or ended: its claim goes."""
        claim = self.held.pop(key, None)
        if claim is not None:
            self._count_tenant(key, claim.tenant, claim.num_tokens, -1)

    def unseen_placements(self) -> tuple[float, float]:
        """(peers' placements this router cannot know of yet, their mean prefill tokens): `UnseenPlacements`."""
        return self.unseen.estimate(self.monotonic())

    def apply(self, msg: list) -> None:
        """One message from a peer: [kind, router, request, replica, *payload]."""
        kind, router, request, replica = msg[0], msg[1], msg[2], msg[3]
        if not all(isinstance(x, str) for x in (router, request, replica)):  # keys of what is kept: checked first
            names = "/".join(type(x).__name__ for x in (router, request, replica))
            raise TypeError(f"router, request and replica must be strings, not {names}")
        key = (router, request)
        self.applied += 1
        self.heard_from[router] = self.monotonic()
        if kind == "routed":
            hashes, num_tokens, block_size, expected_out, tenant, matched = msg[4:10]
            if tenant is not None and not isinstance(tenant, str):
                raise TypeError(f"tenant must be a string, not {type(tenant).__name__}")
            info = RequestInfo(
                block_hashes=[int(h) for h in hashes],
                num_tokens=int(num_tokens),
                block_size=int(block_size),
                expected_output_tokens=int(expected_out),
                tenant=tenant,
                request_id=f"peer:{router}:{request}",
            )
            hbm, host, shared = (int(x) for x in matched)
            stamp = float(msg[10]) if len(msg) > 10 else None  # stamped by the peer when it placed the request
            free = bool(msg[11]) if len(msg) > 11 else True
            view = ReplicaView(replica_id=replica, hbm_blocks=hbm, host_blocks=host, shared_blocks=shared)
            arrived = self.monotonic()
            placed = PeerPlacement(
                replica,
                info,
                uncached=info.num_tokens - shared * info.block_size,
                view=view,
                predict=self._predict(),
                seen=arrived,
            )
            # checked whole first: a bad message leaves nothing half-applied; counted before an earlier call of it
            # or its held claim is let go, so its tenant's count does not dip meanwhile
            self._count_tenant(key, tenant, info.num_tokens, +1)
            self._close(key)
            self._unhold(key)
            self.placements[key] = placed
            self._credit(placed, +1)
            self._in_flight_ids[key[1]] = self._in_flight_ids.get(key[1], 0) + 1
            if stamp is not None:
                self.unseen.heard(stamp, self.clock(), placed.uncached, free, router=router, at=arrived)
            if _has_replica(self.index, replica):  # a replica this router forgot first stays forgotten
                for policy in self.policies():
                    policy.on_routed(info, replica, view)
                self.index.speculate(replica, info.block_hashes, fresh=placed.fresh)
        elif kind == "held":  # committed, held for a prefix in flight: its tenant's request, nothing more yet
            tenant, num_tokens = msg[4], int(msg[5])
            if tenant is not None and not isinstance(tenant, str):
                raise TypeError(f"tenant must be a string, not {type(tenant).__name__}")
            if tenant is not None and key not in self.placements and key not in self.held:
                self.held[key] = HeldRequest(tenant, num_tokens, self.monotonic())
                self._count_tenant(key, tenant, num_tokens, +1)
        elif kind == "unrouted":
            self._unhold(key)
            moved = self._close(key)
            if moved is None and key in self.ended and self.ended[key].replica == replica:
                # the rejected call's `done` came before this (its replica refused it, Serve reported that
                # call complete, then routed the request again): the placement waits among the ended
                moved = self.ended.pop(key)
                moved.release()
            if moved is not None and moved.replica == replica:
                for policy in self.policies():
                    policy.on_unrouted(moved.info, replica)
                if moved.fresh:
                    self.index.withdraw(replica, moved.fresh)
        elif kind == "started":
            started = self.placements.get(key)
            if started is not None:
                if not started.started:
                    self._credit(started, -1)
                    started.started = True
                    self._credit(started, +1)
                started.release()
                self._computed(started)
            else:
                ended = self.ended.pop(key, None)
                if ended is not None:
                    ended.started = True
                    ended.release()
                    self._record_prefill(ended)
                    self._computed(ended)
        elif kind == "done":
            self._unhold(key)  # sent while its `routed` was lost: its `done` still ends its claim
            done = self._pop(key)
            if done is not None and done.started:
                self._record_prefill(done)
            elif done is not None:  # its `started` may follow: waiters wait for it (or their timeout)
                self.ended[key] = done
                while len(self.ended) > 1024:  # failed before a token: never started
                    self.ended.popitem(last=False)[1].release()
        elif kind == "live":  # the peer's requests still in flight: they go on counting however long they run
            now = self.monotonic()
            for request_id in msg[4]:
                alive: PeerPlacement | HeldRequest | None = self.placements.get((router, request_id))
                if alive is None:
                    # held (its `routed` lost: sent and running), or on a replica forgotten here, draining
                    alive = self.held.get((router, request_id))
                if alive is not None:
                    alive.seen = now
        elif kind == "clock":  # the peer's stamp, and the least it observed of each router lately
            sent_at, least = float(msg[4]), msg[5]
            if not isinstance(least, dict):
                raise TypeError(f"a clock message holds a mapping, not {type(least).__name__}")
            theirs = least.get(self.router_id) if self.router_id is not None else None
            theirs = float(theirs) if theirs is not None else None  # checked whole first, as `routed` is
            epoch = int(msg[6]) if len(msg) > 6 else 0
            epochs = msg[7] if len(msg) > 7 else {}
            if not isinstance(epochs, dict):
                raise TypeError(f"a clock message's epochs are a mapping, not {type(epochs).__name__}")
            mine = epochs.get(self.router_id) if self.router_id is not None else None
            mine = int(mine) if mine is not None else None
            now = self.clock()
            self.unseen.clocks.peer_epoch(router, epoch)
            self.unseen.clocks.observe(router, sent_at, now)
            if theirs is not None:
                self.unseen.clocks.reported(router, theirs, now, mine)
        elif kind == "bye":
            self.drop_router(router)

    def _predict(self):
        """A policy's `predict` (the same cost model serves every kvmesh policy), or None."""
        for policy in self.policies():
            predict = getattr(policy, "predict", None)
            if predict is not None:
                return predict
        return None

    def _computed(self, placed: PeerPlacement) -> None:
        if self.on_computed is not None:
            self.on_computed(placed.info)

    def _record_prefill(self, placed: PeerPlacement) -> None:
        if self.tiers is not None and _has_replica(self.index, placed.replica):
            self.tiers.record_prefill(placed.replica, placed.info.block_hashes)

    def _pop(self, key: tuple[str, str], heard: bool = True) -> PeerPlacement | None:
        """Take a placement out of those in flight (and out of its tenant's count). `heard`: its router said
        it ended or moved (`done`, `unrouted`, a new `routed`), so an engine report still naming it is known
        to be stale; a placement dropped unheard (its router gone or silent, its replica forgotten) may still
        run, and a report naming it counts it as work no router here knows of."""
        placed = self.placements.pop(key, None)
        if placed is not None:
            self._credit(placed, -1)
            self._count_tenant(key, placed.info.tenant, placed.info.num_tokens, -1)
            left = self._in_flight_ids.pop(key[1], 1) - 1
            if left > 0:  # two routers' requests under one id: not expected (uuids), kept exact anyway
                self._in_flight_ids[key[1]] = left
            if heard:
                self._left_ids.add(key[1])
            else:
                self.dropped_unheard += 1
        return placed

    def knows(self, request_id: str) -> bool:
        """Whether `request_id` is a peer's request in flight here, or one that left lately: an engine's load
        report, a stats period old at most, may still name it (`load_report.LoadReports`)."""
        return request_id in self._in_flight_ids or request_id in self._left_ids

    def _close(self, key: tuple[str, str], heard: bool = True) -> PeerPlacement | None:
        """Stop tracking a placement in flight; requests waiting for its first token go on (`_pop`'s `heard`)."""
        placed = self._pop(key, heard)
        if placed is not None:
            placed.release()
        return placed

    def _discard(self, key: tuple[str, str]) -> None:
        """Stop tracking a placement in flight, held, or ended awaiting its `started`, unheard (`_pop`): its
        waiters go on."""
        self._close(key, heard=False)
        self._unhold(key)
        ended = self.ended.pop(key, None)
        if ended is not None:
            ended.release()

    def drop_router(self, router: str) -> None:
        """A peer left: its requests no longer count as load here (their prefixes stay until evicted)."""
        for key in [k for k in (*self.placements, *self.ended, *self.held) if k[0] == router]:
            self._discard(key)
        self.unseen.clocks.forget(router)
        self.heard_from.pop(router, None)

    def forget_replica(self, replica: str) -> None:
        """Serve stopped listing `replica`: the peers' placements there no longer count as its load, prefixes
        or policy state. A replica Serve stops still finishes what it runs (up to its `drain_timeout_s`), so
        each of those requests goes on counting for its tenant's fleet-wide limits, as a claim on no replica
        (`held`), until its `done`, its router's `bye`, or the TTL (`live` renews it)."""
        for key in [k for k, p in self.placements.items() if p.replica == replica]:
            info = self.placements[key].info
            if info.tenant is not None and key not in self.held:  # claimed before the placement goes: no dip
                self.held[key] = HeldRequest(info.tenant, info.num_tokens, self.placements[key].seen)
                self._count_tenant(key, info.tenant, info.num_tokens, +1)
            self._close(key, heard=False)
        for key in [k for k, p in self.ended.items() if p.replica == replica]:
            self.ended.pop(key).release()

    def expire(self, now: float | None = None) -> None:
        now = self.monotonic() if now is None else now
        for key in [k for k, p in self.placements.items() if now - p.seen > PLACEMENT_TTL_S]:
            self._close(key, heard=False)
        for key in [k for k, h in self.held.items() if now - h.seen > PLACEMENT_TTL_S]:
            self._unhold(key)

    def pending(self) -> dict[str, list[int]]:
        """Per replica: [in flight, started, pending prefill tokens] of other routers' requests (a copy of the
        totals kept as placements come and go: as many rows as replicas, whatever the peers have in flight)."""
        return {replica: list(row) for replica, row in self._totals.items()}

    def _credit(self, placed: PeerPlacement, sign: int) -> None:
        """Add (+1) or take off (-1) `placed` in its replica's totals (`pending`), as it is now."""
        row = self._totals.setdefault(placed.replica, [0, 0, 0])
        row[0] += sign
        if placed.started:
            row[1] += sign
        else:
            row[2] += sign * placed.uncached
        if row[0] <= 0:
            del self._totals[placed.replica]


def _has_replica(index, replica: str) -> bool:
    """Whether `index` has `replica`, without listing its replicas for every message (a stand-in index that
    only lists them is asked for the list)."""
    has = getattr(index, "has_replica", None)
    return has(replica) if has is not None else replica in index.replicas()


def routed_message(
    router: str,
    info: RequestInfo,
    replica: str,
    matched: tuple[int, int, int],
    sent_at: float | None = None,
    free: bool = True,
) -> list:
    """What a router publishes when it commits `info` to `replica` (block hashes and counts only), with
    the wall-clock time it did (`sent_at`, default now), from which peers measure the stream's lag, and
    whether it was free to choose the replica (`is_free_choice`)."""
    return [
        "routed",
        router,
        info.request_id,
        replica,
        list(info.block_hashes),
        info.num_tokens,
        info.block_size,
        info.expected_output_tokens,
        info.tenant,
        list(matched),
        time.time() if sent_at is None else sent_at,
        bool(free),
    ]


def held_message(router: str, info: RequestInfo) -> list:
    """What a router publishes when it commits `info` but holds it for a prefix another replica is computing:
    ["held", router, request, "", tenant, prompt tokens]. Why: the request is admitted and counts towards its
    tenant's fleet-wide limits from now, though its `routed` (replica, prefix) waits for the hold to end; it
    names no replica, which does not have its prefix yet. A peer of an older version ignores the kind."""
    return ["held", router, info.request_id, "", info.tenant, info.num_tokens]


def _registry_class():
    import ray

    @ray.remote(num_cpus=0)
    class RouterRegistry:
        """Where each ingress replica's router says how to reach its placement stream."""

        def __init__(self) -> None:
            self.entries: dict[str, tuple[str, float]] = {}

        def heartbeat(self, router: str, endpoint: str) -> dict[str, str]:
            # one process stamps and reads every entry: on its monotonic clock, a step of the wall clock
            # neither keeps a dead router listed (back) nor drops every live one with its placements (forward)
            now = time.monotonic()
            self.entries[router] = (endpoint, now)
            for gone in [r for r, (_, t) in self.entries.items() if now - t >= PEER_TTL_S]:
                del self.entries[gone]  # a router that died without `leave`
            return {r: e for r, (e, t) in self.entries.items() if r != router}

        def leave(self, router: str) -> None:
            self.entries.pop(router, None)

    return RouterRegistry


class RouterSync:
    """The placement stream of one router: a PUB socket for its own placements, one SUB socket for its
    peers', and a registry heartbeat that finds them. Runs on the router's event loop."""

    def __init__(self, app_name: str, placements: PeerPlacements, poll_s: float = 1.0) -> None:
        self.app_name = app_name
        self.router_id = uuid.uuid4().hex[:12]
        self.placements = placements
        self.poll_s = poll_s
        self.peers: dict[str, str] = {}  # router id -> endpoint
        self._endpoints: set[str] = set()  # endpoints the SUB socket is connected to
        self.published = 0
        self.frames = 0  # frames sent: a frame carries every message published in one turn of the loop
        self._outbox: list[list] = []
        self._batch_loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.monotonic()
        self.first_peer_s: float | None = None  # start -> first peer placement applied
        self.bad_messages = 0  # peers' messages dropped as malformed
        self.first_connect_s: float | None = None  # start -> subscribed to a peer's stream
        self._pub: Any = None
        self._sub: Any = None
        self._tasks: list[asyncio.Task] = []
        self._registry: Any = None
        self._server: Any = None
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._reader_fd = -1
        # this router's requests in flight (the router sets it): named to the peers every LIVE_EVERY_S
        self.own_requests: Callable[[], list[str]] | None = None
        self._live_at = self._monotonic()
        self.registry_timeout_s = REGISTRY_TIMEOUT_S

    # ------------------------------------------------------------------ start / stop
    def start(self) -> None:
        """Open the stream (`open`) and start finding peers and reading their placements."""
        self.open()
        self.batch_on(asyncio.get_running_loop())
        self._tasks = [asyncio.create_task(self._discover()), asyncio.create_task(self._upkeep())]
        self.read_when_ready(asyncio.get_running_loop())
        log.info("router sync %s publishing at %s", self.router_id, self.endpoint)

    def connect(self, router: str, endpoint: str) -> None:
        """Subscribe to a peer's stream (discovery calls this for every peer the registry names), once per
        endpoint: a second connection to one would deliver each of its messages twice."""
        if endpoint not in self._endpoints:
            self._sub.connect(endpoint)
            self._endpoints.add(endpoint)
        self.peers[router] = endpoint
        if self.first_connect_s is None:
            self.first_connect_s = time.monotonic() - self.started_at
        log.info("router sync: peer %s at %s", router, endpoint)

    def _disconnect(self, endpoint: str) -> None:
        self._endpoints.discard(endpoint)
        with contextlib.suppress(Exception):
            self._sub.disconnect(endpoint)

    def open(self) -> None:
        """Bind this router's PUB socket and make its SUB socket, both CURVE with the deployment's channel
        keys; without them there is no stream (ChannelError): in the clear, any local process could read the
        tenants' placements or inject its own (and throttle a tenant fleet-wide with them)."""
        import zmq

        from kvmesh.cluster.secure_channel import ChannelServer, channel_keys, secure_client

        host = _node_host()
        keys = channel_keys()
        self._server = ChannelServer(keys)
        pub = self._server.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, STREAM_HWM)
        _heartbeat(pub)
        port = pub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        sub: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)  # plain: read by `drain`, no future per message
        secure_client(sub, keys)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, STREAM_HWM)
        _heartbeat(sub)
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self._pub, self._sub = pub, sub
        self.placements.router_id = self.router_id  # its entry in the peers' `clock` messages

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.publish(["bye", self.router_id, "", ""])
            self.flush()
        if self._reader_loop is not None:
            with contextlib.suppress(Exception):
                self._reader_loop.remove_reader(self._reader_fd)
            self._reader_loop = None
        for t in self._tasks:
            t.cancel()
        for s in (self._pub, self._sub):
            if s is not None:
                s.close(0)
        self._pub = self._sub = None  # publish and drain are no-ops from here on
        if self._server is not None:
            self._server.close()
        if self._registry is not None:
            with contextlib.suppress(Exception):
                self._registry.leave.remote(self.router_id)

    # ------------------------------------------------------------------ publish
    def batch_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Publish from `loop` (the router's) in batches: what is published during one turn of the loop
        leaves as one frame at the start of the next. Why: a frame, not its size, is what the stream
        costs (about 0.25 ms of CPU per frame across sender and receiver, from the send to the woken
        reader), and a router publishes three messages per request (`routed`, `started`, `done`).
        Without a loop each message is sent at once."""
        self._batch_loop = loop

    def publish(self, msg: list) -> None:
        """Queue `msg` for this turn's frame (sent at once without `batch_on`). Never waits: a full send
        queue drops the frame (peers then see a little less load)."""
        if self._pub is None:
            return
        self._outbox.append(msg)
        if len(self._outbox) == 1:
            if self._batch_loop is not None and not self._batch_loop.is_closed():
                self._batch_loop.call_soon(self.flush)
            else:
                self.flush()

    def flush(self) -> None:
        """Send the queued messages, in order, as frames of at most FRAME_MAX_BYTES: a message alone is
        itself, more are ["batch", router, "", "", [messages...]] (a message over the limit goes alone)."""
        batch, self._outbox = self._outbox, []
        if not batch or self._pub is None:
            return
        import msgpack
        import zmq

        packed = [msgpack.packb(m) for m in batch]
        head = msgpack.packb("batch") + msgpack.packb(self.router_id) + msgpack.packb("") * 2
        limit = FRAME_MAX_BYTES - len(head) - 16  # the two array headers: 5 bytes at most each
        group: list[bytes] = []
        size = 0
        for i, message in enumerate(packed):
            group.append(message)
            size += len(message)
            following = len(packed[i + 1]) if i + 1 < len(packed) else None
            if following is not None and size + following <= limit:
                continue
            if len(group) == 1:
                frame = group[0]
            else:  # what msgpack.packb(["batch", router, "", "", messages]) makes, each message packed once
                packer = msgpack.Packer()
                frame = packer.pack_array_header(5) + head + packer.pack_array_header(len(group)) + b"".join(group)
            try:
                self._pub.send(frame, flags=zmq.NOBLOCK)
                self.published += len(group)
                self.frames += 1
            except zmq.Again:
                pass
            group, size = [], 0

    # ------------------------------------------------------------------ background tasks
    async def _discover(self) -> None:
        """Heartbeat the registry every poll and follow its list of peers. A heartbeat unanswered for
        `registry_timeout_s` (the registry's node frozen or cut off: Ray declares it dead only after about
        a minute) is given up and tried again at the next poll."""
        import ray

        name = REGISTRY_NAME.format(app=self.app_name)
        while True:
            try:
                if self._registry is None:
                    self._registry = (
                        _registry_class()
                        .options(name=name, namespace=REGISTRY_NAMESPACE, get_if_exists=True, lifetime="detached")
                        .remote()
                    )
                heartbeat = self._registry.heartbeat.remote(self.router_id, self.endpoint)
                async with asyncio.timeout(self.registry_timeout_s):  # a cancel coming with the answer ends it
                    peers = await heartbeat
                self._follow(peers)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                log.warning("router sync: registry heartbeat unanswered for %.0f s; retrying", self.registry_timeout_s)
            except ray.exceptions.RayActorError:
                self._registry = None  # the registry died with its node: make it again
            except Exception:  # never let discovery end the router
                log.exception("router sync: discovery failed; retrying")
            await asyncio.sleep(self.poll_s)

    def _follow(self, peers: dict[str, str]) -> None:
        """Connect to the peers the registry lists; drop those it no longer lists and nothing has arrived
        from for PEER_TTL_S. Why both: a registry made again after its node died starts empty, and its
        answer alone would drop every live peer with its placements and its tenants' requests in flight
        (a tenant capped fleet-wide could then run twice its limit), though their streams still arrive."""
        now = self.placements.monotonic()
        listed = set(peers.values())
        # the departed first: a router restarted on a freed port has the endpoint a departed one had,
        # and disconnecting that endpoint after connecting the new router would drop the new one
        for router in set(self.peers) - set(peers):
            heard = self.placements.heard_from.get(router)
            if heard is not None and now - heard < PEER_TTL_S and self.peers[router] not in listed:
                continue  # still streaming, and its endpoint is no other router's now
            endpoint = self.peers.pop(router)
            if endpoint not in listed:
                self._disconnect(endpoint)
            self.placements.drop_router(router)
        for router, endpoint in peers.items():
            if self.peers.get(router) != endpoint:
                self.connect(router, endpoint)
        heard_from = self.placements.heard_from  # routers heard of only inside other frames: not kept for ever
        for router in [r for r, t in heard_from.items() if r not in self.peers and now - t >= PEER_TTL_S]:
            del heard_from[router]

    async def _upkeep(self) -> None:
        """Every poll, whatever the registry does: expire peers' placements, name this router's requests
        in flight (`live`) and publish its clock message."""
        while True:
            try:  # never let upkeep end
                self.placements.expire()
                self.publish_live()
                self.publish_clock()
            except Exception:
                log.exception("router sync: upkeep failed; retrying")
            await asyncio.sleep(self.poll_s)

    def publish_live(self, now: float | None = None) -> None:
        """Every LIVE_EVERY_S, name this router's requests in flight to the peers (`live`): a request
        running longer than PLACEMENT_TTL_S (a long generation) keeps counting there as load and towards
        its tenant's fleet-wide concurrency, while one whose `done` was lost still expires."""
        now = self._monotonic() if now is None else now
        if self.own_requests is None or now - self._live_at < LIVE_EVERY_S:
            return
        self._live_at = now
        try:
            ids = self.own_requests()
        except Exception:  # never let discovery end the router
            log.exception("router sync: requests in flight not named")
            return
        if ids:
            self.publish(["live", self.router_id, "", "", ids])

    def _monotonic(self) -> float:
        """The clock `live` is timed on: the placements' (`PeerPlacements.monotonic`), whose expiry it races."""
        placements = self.placements
        return placements.monotonic() if placements is not None else time.monotonic()

    def publish_clock(self) -> None:
        """Tell the peers, every poll, the least one-way time observed from each (`PeerClocks`): their
        clock offsets need both directions, and an idle router sends nothing else."""
        if not self.peers:
            return
        try:
            self.publish(self.placements.clock_message(self.router_id))
        except Exception:  # never let discovery end the router
            log.exception("router sync: clock message not sent")

    def drain(self) -> int:
        """Apply every peer message already received, in order, without waiting; returns how many (a batch
        counts its messages).

        The router calls this before it ranks a request: a loop busy routing (a burst of requests, a slow
        first call) would otherwise rank on a view without placements already sitting in the socket.
        The loop also calls it when the socket turns readable (`read_when_ready`). Both run on the
        router's loop and this is the socket's only reader, so messages apply in the order they were
        sent. `EVENTS` is asked first: a receive that finds nothing costs more than the check."""
        import zmq

        n = 0
        sub = self._sub
        while sub is not None and sub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                raw = sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += self._apply(raw)
        return n

    def read_when_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drain the stream whenever its socket signals (ZMQ's descriptor is edge-triggered: `drain`
        reads until `EVENTS` says empty, which re-arms it)."""
        import zmq

        self._reader_fd = self._sub.getsockopt(zmq.FD)
        self._reader_loop = loop
        loop.add_reader(self._reader_fd, self._on_readable)
        self._on_readable()  # what arrived before the reader was added

    def _on_readable(self) -> None:
        try:
            self.drain()
        except Exception:  # never let the stream's reader end
            log.exception("router sync: receive failed")

    def _apply(self, raw: bytes) -> int:
        """Apply one frame (a message or a batch of them, in order); returns how many messages it held."""
        import msgpack

        try:
            msg = msgpack.unpackb(raw)
            if msg[1] == self.router_id:
                return 0
            msgs = msg[4] if msg[0] == "batch" else [msg]
            if not isinstance(msgs, list):
                raise TypeError(f"a batch holds a list of messages, not {type(msgs).__name__}")
        except Exception:  # a malformed frame is dropped, the stream goes on
            log.exception("router sync: bad frame dropped")
            return 1
        for m in msgs:  # one bad message drops itself, not the peer's other messages of the frame
            try:
                self.placements.apply(m)
            except Exception:
                self.bad_messages += 1
                log.exception("router sync: bad message dropped")
        if self.first_peer_s is None and any(not (isinstance(m, list) and m and m[0] == "clock") for m in msgs):
            self.first_peer_s = time.monotonic() - self.started_at  # a peer's traffic, not its idle clock message
        return len(msgs)

    def stats(self) -> dict:
        unseen = self.placements.unseen
        count, lag_total, lag_max = unseen.lag_stats()
        return {
            "router": self.router_id,
            "endpoint": getattr(self, "endpoint", None),
            "peers": sorted(self.peers),
            "published": self.published,
            "frames": self.frames,
            "applied": self.placements.applied,
            "bad_messages": self.bad_messages,
            "peer_inflight": len(self.placements.placements),
            "unseen_placements": round(self.placements.unseen_placements()[0], 3),
            "lag_ms_mean": round(1000 * lag_total / count, 2) if count else None,
            "lag_ms_max": round(1000 * lag_max, 2) if count else None,
            # per peer: this router's clock minus the peer's, as estimated (ms); taken off its lags
            "clock_offset_ms": {r: round(1000 * o, 3) for r, o in sorted(unseen.clocks.offsets.items())},
            "first_peer_connect_s": self.first_connect_s,
            "first_peer_placement_s": self.first_peer_s,
        }


def _heartbeat(sock: Any) -> None:
    """ZMQ heartbeats on a stream socket: a peer that answers nothing (frozen, its TCP connection still open)
    is disconnected after STREAM_HEARTBEAT_TIMEOUT_MS, and what was queued for it freed."""
    import zmq

    sock.setsockopt(zmq.HEARTBEAT_IVL, STREAM_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, STREAM_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, STREAM_HEARTBEAT_TIMEOUT_MS)  # how long the other side waits for us


def _node_host() -> str:
    """This node's address as Ray knows it (loopback in local runs)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"

"""How far behind the other routers' placement streams this router is: each peer's clock offset, and the
peers' placements not heard of yet.

Why a module of its own: the live router (`router_sync.PeerPlacements`) and the simulator's routers
(`kvmesh.cluster.multi_router`) count the unseen placements with the same code, and the policy spreads new
prefixes by that count (`KvmeshPolicy._unseen_pick`). A placement's lag is this router's arrival time minus
the peer's stamp, two hosts' clocks: the clock offset is taken off first."""

from __future__ import annotations

import math
from collections import deque

from kvmesh.policies.base import two_longest

UNSEEN_WINDOW_S = 2.0  # peers' placement rate and the stream's lag are measured over this much recent time
CLOCK_WINDOW_S = 10.0  # a peer's clock offset is estimated from its fastest messages of this much recent time
CLOCK_BUCKET_S = 1.0  # the fastest message is kept per this much time (a peer's clock message comes every poll)
CLOCK_MAX_S = 60.0  # a one-way time or clock offset beyond this is not a skew to correct: ignored
CLOCK_MAX_PEERS = 1024  # peers whose clocks are tracked at once (far more than ingress replicas)
# a change this large in wall minus monotonic time between two looks is the wall clock being stepped (NTP
# slews at most 0.5 ms a second; a step is typically 128 ms or more), not drift
CLOCK_STEP_S = 0.05


def is_free_choice(shared_blocks) -> bool:
    """Was a placement, ranked with these cached prefix lengths per candidate (blocks), free to go to more
    than one replica? True when no replica alone holds the longest prefix (nothing cached, or a shared
    prompt two or more hold); False for a request that follows its own history to the one replica holding
    it. Only free placements compete with a router's own new prefixes for the same replicas."""
    longest, common = two_longest(shared_blocks)
    return longest <= common


class PeerClocks:
    """Each peer's wall-clock offset from this router's clock, from the two one-way streams (NTP's
    symmetric estimate, without round trips).

    Why: a placement's lag is this router's arrival time minus the peer's stamp, two hosts' clocks, so
    their skew is taken for lag: +10 ms multiplies the unseen estimate, a clock behind clamps it to none.
    What this router observes of a peer's messages (`observe`) is their delay plus (this clock - the
    peer's); what the peer observes of this router's is its delay minus the same. Each router publishes
    the least it observed from each peer over the last `window_s` (`PeerPlacements.clock_message`): the
    least is the message that queued least (NTP's minimum-delay filter), so a burst does not bias it. So
    offset = (least here - least there) / 2, exact when the two fastest delays are equal, and estimated
    again at every report of the peer (each poll), which follows drift. Until a peer has reported (an
    older version never does), its offset is unknown and its lags count as they are.

    A clock that is stepped (NTP, a VM resumed) makes the least observed before the step wrong for a whole
    window on one side: a step forward lowers what the peer observes at once, but raises what this router
    observes, whose least stays the old one, and the estimate would be off by half the step for
    `window_s`. So each router watches its own wall clock against the monotonic one (`own_clock`), forgets
    what it observed when it steps and counts the step in `epoch`, which it publishes; a peer's new epoch
    makes this router forget what it observed of that peer (`peer_epoch`).

    Its window ages on the wall clock its observations are on (`heard_at`, `now`): those observed before a
    step are wrong after it anyway, and are forgotten once it is seen (`own_clock`, at the next poll; a
    clock set back, at the next observation)."""

    def __init__(self, window_s: float = CLOCK_WINDOW_S, bucket_s: float = CLOCK_BUCKET_S) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._least: dict[str, deque[list[float]]] = {}  # per peer: [bucket start, least observed] oldest first
        self.offsets: dict[str, float] = {}  # per peer: this clock minus the peer's (s), once estimated
        self.epoch = 0  # steps of this router's wall clock seen so far (`own_clock`), told to the peers
        self._gap: float | None = None  # wall minus monotonic time at the last look
        self._peer_epochs: dict[str, int] = {}  # per peer, the epoch of its clock last heard

    def own_clock(self, wall: float, monotonic: float) -> bool:
        """Look at this router's wall clock against its monotonic one; if it was stepped since the last
        look, forget everything observed on the old clock (and the offsets from it) and count the step."""
        gap = wall - monotonic
        stepped = self._gap is not None and math.isfinite(gap) and abs(gap - self._gap) > CLOCK_STEP_S
        self._gap = gap if math.isfinite(gap) else self._gap
        if stepped:
            self._least.clear()
            self.offsets.clear()
            self.epoch += 1
        return stepped

    def peer_epoch(self, router: str, epoch: int) -> None:
        """`router`'s clock is in `epoch`: one it did not have before was stepped since, so what this router
        observed of it and its offset are forgotten."""
        known = self._peer_epochs.get(router)
        if known is None and len(self._peer_epochs) >= CLOCK_MAX_PEERS:
            return
        if known is not None and known != epoch:
            self._least.pop(router, None)
            self.offsets.pop(router, None)
        self._peer_epochs[router] = epoch

    def observe(self, router: str, sent_at: float, heard_at: float) -> None:
        """A message of `router` stamped `sent_at` (its clock) arrived at `heard_at` (this router's)."""
        seen = heard_at - sent_at
        if not (math.isfinite(seen) and math.isfinite(heard_at) and abs(seen) <= CLOCK_MAX_S):
            return
        least = self._least.get(router)
        if least is None:
            if len(self._least) >= CLOCK_MAX_PEERS:
                return
            least = self._least[router] = deque()
        start = heard_at - heard_at % self.bucket_s
        if least and start < least[-1][0]:
            least.clear()  # this clock was set back: what it observed before is on a clock no longer used
        if least and least[-1][0] == start:
            least[-1][1] = min(least[-1][1], seen)
        else:
            least.append([start, seen])
        self._drop(least, heard_at)

    def least(self, router: str, now: float) -> float | None:
        """The least this router observed of `router`'s messages (delay plus offset) lately, or None."""
        least = self._least.get(router)
        if least is None:
            return None
        self._drop(least, now)
        return min(seen for _, seen in least) if least else None

    def minimums(self, now: float) -> dict[str, float]:
        """What this router tells its peers: per peer, the least it observed of its messages lately."""
        out = {}
        for router in list(self._least):
            seen = self.least(router, now)
            if seen is None:
                del self._least[router]
            else:
                out[router] = seen
        return out

    def reported(self, router: str, theirs: float, now: float, epoch: int | None = None) -> None:
        """`router` observed at least `theirs` of this router's messages (under this router's clock `epoch`;
        None from an older peer): estimate its offset again. A report observed before this clock's last
        step is not used."""
        mine = self.least(router, now)
        if mine is None or not (math.isfinite(theirs) and abs(theirs) <= CLOCK_MAX_S):
            return
        if epoch is not None and epoch != self.epoch:
            return
        offset = (mine - theirs) / 2
        if router in self.offsets or len(self.offsets) < CLOCK_MAX_PEERS:
            self.offsets[router] = offset

    def epochs(self, routers) -> dict[str, int]:
        """Per router, the epoch of its clock that what this router observed of it was observed under (told
        with the least observed: a report from before a peer's step is on the clock the peer left)."""
        return {r: self._peer_epochs[r] for r in routers if r in self._peer_epochs}

    def forget(self, router: str) -> None:
        self._least.pop(router, None)
        self.offsets.pop(router, None)
        self._peer_epochs.pop(router, None)

    def _drop(self, least: deque[list[float]], now: float) -> None:
        while least and least[0][0] <= now - self.window_s:
            least.popleft()


class UnseenPlacements:
    """How many placements other routers have made that this router has not heard of yet, and their
    mean prefill work.

    A peer's placement reaches this router one stream lag after it was made, so at any moment the peers'
    placements of the last lag are unknown here: where they went, and that they exist. Their number is
    the peers' placement rate times the lag (Little's law), per peer: its free placements heard in the
    last `window_s` over the time they were made in (at least `window_s`), times the lag of the last one
    heard (heard minus sent). With no peers, or a stream without lag, it is 0. The policy places a request
    as one of them (`FleetView.unseen_placements`, `KvmeshPolicy._unseen_pick`).

    Why the latest lag and the time they were made in, not each placement's lag summed over the window: a
    backlog drained at once (this router's loop stalled, a peer resumed) holds placements of up to the
    stall's lag, all heard now; summed, 10 s of a peer's 50 a second read as 1250 unseen for the next 2 s,
    when the stream has just caught up and about none are.

    Only free placements (`is_free_choice`) are counted: a conversation's next turn goes to the one
    replica holding its history, whichever router ranks it, so it does not compete for the replicas a
    new prefix may take. Counting every placement spread requests wider than the competition does
    (simulated, 256 replicas, 16 routers 100 ms apart, Mooncake synthetic trace, policy seeds 0-4:
    0.979 -> 0.982 of one router's hit rate; at 1 s on a generated chat workload 0.68 -> 0.75). The
    mean work stays over every placement heard: each adds its prefill to some replica's queue.

    A placement heard with its `router` is measured on that peer's clock offset (`clocks`, once estimated):
    the lag is the stream's, not the hosts' clock skew. Where the offset is unknown and the lag is beyond
    CLOCK_MAX_S, it is a skew too large to correct (`PeerClocks` ignores it), not a lag: such a placement
    counts towards the mean work only.

    The window ages on a clock of its own (`heard`'s `at`, `estimate`'s `now`: the live router's monotonic
    clock), the wall clock serving only the lag, which compares with the peer's stamp. On the wall clock, a
    step back would leave every placement heard before it in the future, kept until the clock caught up
    (the window growing with each placement heard, the estimate inflated); a step forward would empty it."""

    def __init__(self, window_s: float = UNSEEN_WINDOW_S) -> None:
        self.window_s = window_s
        self._heard: deque[tuple[float, float, float]] = deque()  # (arrived at, window's clock; lag; prefill tokens)
        self._tokens_sum = 0.0
        # per peer (None: placements heard without their router, the simulator's): `_PeerStream`
        self._peers: dict[str | None, _PeerStream] = {}
        self.count = 0  # every placement heard, and their lag: the stream's latency as /kvmesh/state shows it
        self.lag_total = 0.0
        self.lag_max = 0.0
        # the same over those whose peer's clock offset was known: what /kvmesh/state shows once there are any
        # (a lag measured before the first exchange holds the hosts' skew, and would stay the maximum)
        self.corrected = [0, 0.0, 0.0]  # count, lag total, lag max
        self.clocks = PeerClocks()

    def heard(
        self,
        sent_at: float,
        heard_at: float,
        tokens: float,
        free: bool = True,
        router: str | None = None,
        at: float | None = None,
    ) -> None:
        """A peer's placement of `tokens` prefill work, made at `sent_at` (the peer's clock), arrived at
        `heard_at` (this router's wall clock). With `router`, the lag is corrected by that peer's clock offset
        once `clocks` has it; a negative lag (skew not, or not yet, corrected) counts as none. `free`: the peer
        was free to choose its replica (`is_free_choice`); only free placements add to the unseen count.
        `at`: its arrival on the clock the window ages on (the router's monotonic one); default `heard_at`,
        where one clock serves both (the simulator)."""
        offset = None
        if router is not None:
            self.clocks.observe(router, sent_at, heard_at)
            offset = self.clocks.offsets.get(router)
        raw = heard_at - sent_at - (offset or 0.0)
        lag = max(raw, 0.0)
        if not math.isfinite(lag) or not math.isfinite(tokens):  # a bad stamp would make every sum NaN for good
            return
        arrived = heard_at if at is None else at
        skewed = offset is None and abs(raw) > CLOCK_MAX_S  # two hosts' clocks, not the stream's lag
        if not skewed:
            self.count += 1
            self.lag_total += lag
            self.lag_max = max(self.lag_max, lag)
            if offset is not None:
                c = self.corrected
                c[0] += 1
                c[1] += lag
                c[2] = max(c[2], lag)
            stream = self._peers.get(router)
            if stream is None and len(self._peers) < CLOCK_MAX_PEERS:
                stream = self._peers[router] = _PeerStream()
            if stream is not None:
                stream.heard(arrived, lag, free, self.window_s)
        self._heard.append((arrived, lag, tokens))
        self._tokens_sum += tokens
        self._drop(arrived)

    def lag_stats(self) -> tuple[int, float, float]:
        """(placements, lag total, lag max) the stream's latency is shown from: those measured on a known
        clock offset where there are any, else all (peers of an older version, one host)."""
        if self.corrected[0]:
            count, total, most = self.corrected
            return int(count), total, most
        return self.count, self.lag_total, self.lag_max

    def estimate(self, now: float) -> tuple[float, float]:
        """(peers' placements made but not heard of here, their mean prefill tokens), expected at `now` (on
        the window's clock: `heard`'s `at`)."""
        self._drop(now)
        if not self._heard:
            return 0.0, 0.0
        unseen = sum(stream.unseen(self.window_s) for stream in self._peers.values())
        return unseen, max(self._tokens_sum, 0.0) / len(self._heard)

    def _drop(self, now: float) -> None:
        heard = self._heard
        while heard and heard[0][0] <= now - self.window_s:
            _, _, tokens = heard.popleft()
            self._tokens_sum -= tokens
        if not heard:
            self._tokens_sum = 0.0  # no float residue once empty
        for router in [r for r, stream in self._peers.items() if not stream.drop(now - self.window_s)]:
            del self._peers[router]


class _PeerStream:
    """One peer's placements heard in the window, for its rate and its latest lag (`UnseenPlacements`).

    Its rate is its free placements over the time they were made in: when each was made is taken on the
    window's clock as its arrival minus its lag (so a step of either wall clock leaves it alone), and a
    backlog heard at once spreads over the time it was made in, not the instant it was drained in."""

    __slots__ = ("made", "free", "lag")

    def __init__(self) -> None:
        self.made: deque[tuple[float, float, bool]] = deque()  # (arrived at, made at, free), in arrival order
        self.free = 0  # free placements among them
        self.lag = 0.0  # the lag of the last placement heard: the stream's now

    def heard(self, arrived: float, lag: float, free: bool, window_s: float) -> None:
        self.made.append((arrived, arrived - lag, free))
        self.free += free
        self.lag = lag
        self.drop(arrived - window_s)

    def drop(self, before: float) -> bool:
        """Forget what arrived at or before `before`; whether anything is left."""
        made = self.made
        while made and made[0][0] <= before:
            self.free -= made.popleft()[2]
        return bool(made)

    def unseen(self, window_s: float) -> float:
        if not self.free:
            return 0.0
        span = self.made[-1][1] - self.made[0][1]
        return self.free / max(window_s, span) * self.lag

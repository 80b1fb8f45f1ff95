"""Peers' clock offsets on the placement stream: two routers on hosts whose wall clocks differ measure the
stream's lag, and so the placements they have not heard of yet, as routers on one clock do."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from kvmesh.deployments import peer_lag
from kvmesh.deployments.router_sync import PeerPlacements, RouterSync, routed_message
from kvmesh.policies.base import RequestInfo


class Index:
    """The index calls peer placements make (kvmesh's own interface)."""

    def replicas(self):
        return ["r0"]

    def speculate(self, replica, hashes, fresh):
        pass

    def withdraw(self, replica, fresh):
        pass


class Hosts:
    """Routers "A" and "B", each on a host whose clock is the true time plus its skew, joined by a stream
    that delivers each message `delay` s later plus a random queueing wait (the same draws in every run)."""

    def __init__(self, skew_a: float, skew_b: float, delay: float = 0.01, seed: int = 0) -> None:
        self.now = 0.0
        self.delay = delay
        self.rng = random.Random(seed)
        self.peers = {}
        for name, skew in (("A", skew_a), ("B", skew_b)):
            p = PeerPlacements(Index(), lambda: [], clock=lambda skew=skew: self.now + skew)
            p.monotonic = lambda: self.now
            p.router_id = name
            self.peers[name] = p
        self.queue: list = []
        self.n = 0

    def send(self, sender: str, msg: list) -> None:
        wait = self.rng.uniform(0.0, 0.0005) + (self.rng.expovariate(1 / 0.002) if self.rng.random() < 0.5 else 0.0)
        self.n += 1
        receiver = "B" if sender == "A" else "A"
        heapq.heappush(self.queue, (self.now + self.delay + wait, self.n, receiver, msg))

    def run(self, until: float, rate: float = 40.0, exchange: bool = True, start: float = 0.0) -> None:
        """From `start`, both routers place `rate` requests a second each (free choices); with `exchange`,
        each also publishes its clock message every second, as `RouterSync.publish_clock` does."""
        events = [(start + k / rate, "place") for k in range(int((until - start) * rate))]
        clocks = range(math.ceil(start - 0.5), math.ceil(until - 0.5))
        events += [(s + 0.5, "clock") for s in clocks] if exchange else []
        events = [(t, what) for t, what in events if start <= t < until]
        for t, what in sorted(events):
            self._deliver(t)
            self.now = t
            for name, p in self.peers.items():
                if what == "clock":
                    self.send(name, p.clock_message(name))
                else:
                    info = RequestInfo(block_hashes=[1], num_tokens=64, block_size=32, request_id=f"{name}{t}")
                    self.send(name, routed_message(name, info, "r0", (0, 0, 0), sent_at=p.clock()))
        self._deliver(until)
        self.now = until

    def _deliver(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            t, _, receiver, msg = heapq.heappop(self.queue)
            self.now = t
            self.peers[receiver].apply(msg)

    def unseen(self, name: str) -> float:
        return self.peers[name].unseen_placements()[0]


@pytest.mark.parametrize("skew_a, skew_b", [(0.010, 0.0), (-0.010, 0.0), (0.004, -0.006)])
def test_skewed_clocks_give_the_unseen_estimate_of_one_clock_once_both_sides_exchanged(skew_a, skew_b):
    same = Hosts(0.0, 0.0)
    same.run(6.0)
    skewed = Hosts(skew_a, skew_b)
    skewed.run(6.0)
    for name in "AB":
        assert same.unseen(name) > 0.4  # 40 a second, heard 10 ms (and a little queueing) late
        assert abs(skewed.unseen(name) - same.unseen(name)) < 0.02, (name, skewed.unseen(name), same.unseen(name))
    offsets = skewed.peers["A"].unseen.clocks.offsets
    assert abs(offsets["B"] - (skew_a - skew_b)) < 0.0005  # A's clock minus B's
    assert abs(skewed.peers["B"].unseen.clocks.offsets["A"] + offsets["B"]) < 0.001


def test_without_an_exchange_a_skewed_stream_is_measured_as_before():
    """Before any clock message (or with peers of an older version) lags are taken as they are: the
    skew counts as lag, and a clock behind its peer's sees none."""
    same, ahead, behind = Hosts(0.0, 0.0), Hosts(0.010, 0.0), Hosts(-0.010, 0.0)
    for hosts in (same, ahead, behind):
        hosts.run(3.0, exchange=False)
        assert hosts.peers["A"].unseen.clocks.offsets == {}
    assert ahead.unseen("A") > same.unseen("A") + 0.3  # 40 a second x 10 ms of skew more
    assert behind.unseen("A") < 0.1
    old = peer_lag.UnseenPlacements()  # the same placements heard without naming their router
    for k in range(100):
        old.heard(k / 40, k / 40 + 0.02, 32.0)
    with_router = peer_lag.UnseenPlacements()
    for k in range(100):
        with_router.heard(k / 40, k / 40 + 0.02, 32.0, router="B")
    assert with_router.estimate(2.5) == old.estimate(2.5)
    assert with_router.lag_stats() == old.lag_stats() == (100, old.lag_total, old.lag_max)


def test_offsets_follow_a_drifting_clock():
    hosts = Hosts(0.010, 0.0)
    a = hosts.peers["A"]
    a.clock = lambda: hosts.now * (1 + 100e-6) + 0.010  # 100 ppm fast: 16 ms ahead after 60 s
    hosts.run(60.0, rate=5.0)
    assert abs(a.unseen.clocks.offsets["B"] - 0.016) < 0.001


@pytest.mark.parametrize("step", [0.3, -0.3])
def test_a_stepped_clock_is_estimated_again_at_the_next_exchange_never_half_wrong(step):
    """B's wall clock is stepped (its monotonic clock is not). Once B's next clock message is out, each
    offset either side holds is the new one (none for a poll, while the new one is estimated); before, one
    side's least stayed the old clock's for a whole window, and the offset read half the step for about
    ten seconds."""
    hosts = Hosts(0.0, 0.0)
    hosts.run(12.0)
    a, b = hosts.peers["A"], hosts.peers["B"]
    assert abs(a.unseen.clocks.offsets["B"]) < 0.0005 and abs(b.unseen.clocks.offsets["A"]) < 0.0005
    b.clock = lambda: hosts.now + step
    t = 12.0
    while t < 24.0:
        hosts.run(t + 0.25, start=t)
        t += 0.25
        for me, peer, truth in ((a, "B", -step), (b, "A", step)):
            offset = me.unseen.clocks.offsets.get(peer)
            if t >= 12.75:  # B's first clock message since the step (sent at 12.5) has arrived
                assert offset is None or abs(offset - truth) < 0.001, (t, peer, offset, truth)
        if t >= 14.0:
            assert set(a.unseen.clocks.offsets) == {"B"} and set(b.unseen.clocks.offsets) == {"A"}, t
    assert b.unseen.clocks.epoch == 1 and a.unseen.clocks.epoch == 0


def test_a_clock_report_from_before_this_clocks_step_is_not_used():
    peers = _established()
    peers.monotonic = lambda: 0.0
    peers.clock_message("A")  # the first look at its own clock
    peers.clock = lambda: 100.5  # stepped half a second forward
    msg = peers.clock_message("A")
    assert msg[6] == 1 and msg[5] == {} and peers.unseen.clocks.offsets == {}
    peers.apply(["clock", "B", "", "", 99.985, {"A": -0.005}, 0, {"A": 0}])  # B's least of the old clock
    assert peers.unseen.clocks.offsets == {}
    peers.apply(["clock", "B", "", "", 99.985, {"A": -0.505}, 0, {"A": 1}])  # observed on the new one
    assert peers.unseen.clocks.offsets["B"] == pytest.approx(0.510)


def test_a_pause_between_reading_the_two_clocks_is_no_step():
    """The wall and monotonic clocks are read one after the other: a pause between the reads (a loaded
    ingress) would shift their difference as a step does, and then shift it back at the next look."""
    peers = _established()
    t, pause = [0.0], [0.0]

    def wall():
        value = 100.0 + t[0]
        t[0] += pause[0]  # the process is held right after this read
        pause[0] = 0.0
        return value

    peers.clock = wall
    peers.monotonic = lambda: t[0]
    peers.clock_message("A")
    for held in (0.0, 0.08, 0.0, 0.0):
        t[0] += 1.0
        pause[0] = held
        msg = peers.clock_message("A")
    assert msg[6] == 0 and abs(peers.unseen.clocks.offsets["B"] - 0.010) < 1e-9


def _established() -> PeerPlacements:
    """A router "A" that measured peer "B" 10 ms behind its clock (B's messages take 15 ms, its take 5)."""
    peers = PeerPlacements(Index(), lambda: [], clock=lambda: 100.0)
    peers.router_id = "A"
    peers.apply(["clock", "B", "", "", 99.985, {"A": -0.005}])
    assert abs(peers.unseen.clocks.offsets["B"] - 0.010) < 1e-9
    return peers


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e9, -1e9])
def test_a_bad_or_huge_clock_report_is_ignored(bad):
    peers = _established()
    peers.apply(["clock", "B", "", "", 99.985, {"A": bad}])
    peers.apply(["clock", "B", "", "", bad, {"A": bad}])
    assert abs(peers.unseen.clocks.offsets["B"] - 0.010) < 1e-9
    fresh = PeerPlacements(Index(), lambda: [], clock=lambda: 100.0)
    fresh.router_id = "A"
    fresh.apply(["clock", "B", "", "", bad, {"A": -0.005}])  # nothing observed of B: no estimate from it
    fresh.apply(["clock", "B", "", "", 99.985, {"A": bad}])
    assert fresh.unseen.clocks.offsets == {}
    info = RequestInfo(block_hashes=[1], num_tokens=64, block_size=32, request_id="q")
    fresh.apply(routed_message("B", info, "r0", (0, 0, 0), sent_at=99.9))
    assert fresh.unseen_placements()[0] == pytest.approx(0.1 / fresh.unseen.window_s)  # sums not poisoned


@pytest.mark.parametrize(
    "payload",
    [
        [99.985, [-0.005]],
        [99.985, "x"],
        ["soon", {"A": 0.0}],
        [99.985, {"A": "x"}],
        [99.985, {"A": -0.005}, "x"],
        [99.985, {"A": -0.005}, 0, [0]],
        [99.985, {"A": -0.005}, 0, {"A": "x"}],
    ],
)
def test_a_malformed_clock_message_is_refused_whole(payload):
    peers = _established()
    with pytest.raises((TypeError, ValueError)):  # RouterSync counts it in `bad_messages` and goes on
        peers.apply(["clock", "B", "", "", *payload])
    assert abs(peers.unseen.clocks.offsets["B"] - 0.010) < 1e-9


def test_lags_are_corrected_in_the_stats_and_the_offset_is_shown():
    peers = _established()
    sync = RouterSync("t", peers)
    info = RequestInfo(block_hashes=[1], num_tokens=64, block_size=32, request_id="q")
    peers.apply(routed_message("B", info, "r0", (0, 0, 0), sent_at=99.985))  # 15 ms on the clocks, 5 ms real
    stats = sync.stats()
    assert stats["clock_offset_ms"] == {"B": 10.0}
    assert stats["lag_ms_mean"] == stats["lag_ms_max"] == 5.0
    assert peers.unseen_placements()[0] == pytest.approx(0.005 / peers.unseen.window_s)
    peers.apply(["bye", "B", "", ""])  # a peer that left takes its clock with it
    assert sync.stats()["clock_offset_ms"] == {}


def test_a_router_publishes_its_clock_message_only_to_peers():
    import msgpack

    now = [100.0]
    peers = PeerPlacements(Index(), lambda: [], clock=lambda: now[0])
    sync = RouterSync("t", peers)
    sent: list[list] = []
    sync.publish = sent.append  # type: ignore[method-assign]
    sync.publish_clock()
    assert sent == []  # no peer to tell
    sync.peers["B"] = "tcp://127.0.0.1:1"
    peers.router_id = sync.router_id  # as `open` sets it
    sync._apply(msgpack.packb(["clock", "B", "", "", 99.985, {}]))  # B: 10 ms behind, 5 ms away
    assert sync.first_peer_s is None  # an idle peer's clock message is not its first placement
    sync.publish_clock()
    assert sent == [["clock", sync.router_id, "", "", 100.0, {"B": pytest.approx(0.015)}, 0, {"B": 0}]]
    now[0] = 100.5
    sync._apply(msgpack.packb(["clock", "B", "", "", 100.485, {sync.router_id: -0.005}]))  # B's report, packed
    assert sync.stats()["clock_offset_ms"] == {"B": 10.0} and sync.bad_messages == 0
    sync._apply(msgpack.packb(["batch", "B", "", "", [["clock", "B", "", "", 1.0, {}], ["live", "B", "", "", []]]]))
    assert sync.first_peer_s is not None


@pytest.mark.parametrize("step", [-600.0, 600.0])
def test_a_stepped_wall_clock_leaves_the_unseen_window_as_it_was(step):
    """This host's wall clock is stepped (NTP, a resumed VM), its monotonic one is not; the peer on it stamps
    on the same wall clock, so every lag stays 50 ms. The window ages on the monotonic clock: on the wall
    one, a step back kept every placement heard before it (the window grew with each placement heard and
    the estimate with it) and a step forward emptied it."""
    wall, mono = [1_000_000.0], [50.0]
    peers = PeerPlacements(Index(), lambda: [], clock=lambda: wall[0])
    peers.monotonic = lambda: mono[0]
    peers.router_id = "A"
    n = [0]

    def hear(seconds: float) -> None:
        for _ in range(round(seconds * 100)):  # 100 placements a second, each heard 50 ms after it was made
            wall[0] += 0.01
            mono[0] += 0.01
            n[0] += 1
            info = RequestInfo(block_hashes=[1], num_tokens=64, block_size=32, request_id=f"q{n[0]}")
            peers.apply(routed_message("B", info, "r0", (0, 0, 0), sent_at=wall[0] - 0.05))

    hear(3.0)
    assert peers.unseen_placements()[0] == pytest.approx(5.0, abs=0.1)  # 100 a second x 50 ms
    wall[0] += step
    for _ in range(20):
        hear(0.5)
        assert peers.unseen_placements()[0] == pytest.approx(5.0, abs=0.1), len(peers.unseen._heard)
        assert len(peers.unseen._heard) <= 201  # the last 2 s of placements, however long since the step


def test_the_router_registry_ages_its_entries_on_its_monotonic_clock(monkeypatch):
    """A step of the registry's wall clock neither keeps a router that stopped heartbeating listed (back)
    nor drops every live one, and their placements with them, from its peers (forward)."""
    import time

    from kvmesh.deployments.router_sync import PEER_TTL_S, _registry_class

    wall, mono = [1_000_000.0], [50.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])
    registry = _registry_class().__ray_actor_class__()
    registry.heartbeat("A", "tcp://a")
    registry.heartbeat("B", "tcp://b")
    wall[0] += 600.0  # forward: B heartbeated a second ago
    mono[0] += 1.0
    assert registry.heartbeat("A", "tcp://a") == {"B": "tcp://b"}
    wall[0] -= 1200.0  # back: B stops heartbeating
    for _ in range(int(PEER_TTL_S) + 1):
        wall[0] += 1.0
        mono[0] += 1.0
        listed = registry.heartbeat("A", "tcp://a")
    assert listed == {}


def _hear_from_b(peers: PeerPlacements, wall: list[float], mono: list[float], stamp_of, n: int, every: float) -> None:
    """`n` placements of peer B, one every `every` s, each stamped by `stamp_of(true time)` and heard 1 ms later."""
    for k in range(n):
        info = RequestInfo(block_hashes=[k], num_tokens=64, block_size=32, request_id=f"b{k}")
        msg = routed_message("B", info, "r0", (0, 0, 0), sent_at=stamp_of(wall[0]))
        wall[0] += 0.001
        mono[0] += 0.001
        peers.apply(msg)
        wall[0] += every - 0.001
        mono[0] += every - 0.001


def test_a_peer_clock_too_far_behind_to_correct_adds_no_unseen_placements():
    """B's wall clock is 100 s behind: past CLOCK_MAX_S its offset is never estimated, and its raw lag is
    the two clocks, not the stream's: counted, 25 placements a second read as 2500 unseen."""
    wall, mono = [1_000_000.0], [50.0]
    peers = PeerPlacements(Index(), lambda: [], clock=lambda: wall[0])
    peers.monotonic = lambda: mono[0]
    peers.router_id = "A"
    _hear_from_b(peers, wall, mono, lambda t: t - 100.0, n=50, every=0.04)
    assert peers.unseen.clocks.offsets == {}
    unseen, tokens = peers.unseen_placements()
    assert unseen < 1.0
    assert tokens == 64  # still placed: their work counts
    assert peers.unseen.lag_stats() == (0, 0.0, 0.0)  # nor shown as the stream's latency


def test_draining_a_backlog_leaves_about_none_unseen():
    """This router's loop stalled for 10 s while B placed 50 a second; the loop resumes and drains the
    backlog at once, the last placement 1 ms after B made it: the stream has caught up, so about none are
    unseen (each drained placement's own lag, summed, read as hundreds for the next 2 s)."""
    wall, mono = [1_000_000.0], [50.0]
    peers = PeerPlacements(Index(), lambda: [], clock=lambda: wall[0])
    peers.monotonic = lambda: mono[0]
    peers.router_id = "A"
    made = []
    for k in range(500):
        info = RequestInfo(block_hashes=[k], num_tokens=64, block_size=32, request_id=f"b{k}")
        made.append(routed_message("B", info, "r0", (0, 0, 0), sent_at=wall[0] + k * 0.02))
    wall[0] += 499 * 0.02 + 0.001
    mono[0] += 499 * 0.02 + 0.001
    for msg in made:
        peers.apply(msg)
    assert peers.unseen_placements()[0] < 0.1  # 50 a second x the 1 ms the stream is behind now
    mono[0] += 1.0
    wall[0] += 1.0
    assert peers.unseen_placements()[0] < 0.1

"""The placement stream over real ZMQ sockets on loopback (no Ray: peers are connected by hand): messages
already received are applied before the next ranking, in the order they were sent, even while the
router's loop never yielded to its reader; and the loop applies them as they arrive."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV, ChannelError, write_channel_secret
from kvmesh.deployments.router_sync import PeerPlacements, RouterSync, routed_message
from kvmesh.policies.base import RequestInfo


@pytest.fixture(autouse=True)
def _channel_secret(tmp_path, monkeypatch):
    """The deployment's channel secret, as every Ray process of a kvmesh app has it."""
    monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(write_channel_secret(tmp_path)))


class Index:
    """The two index calls peer placements make (kvmesh's own interface)."""

    def replicas(self):
        return ["r0", "r1"]

    def speculate(self, replica, hashes, fresh):
        fresh.extend(hashes)

    def withdraw(self, replica, fresh):
        pass


def _pair() -> tuple[RouterSync, RouterSync]:
    a = RouterSync("t", PeerPlacements(Index(), lambda: []))
    b = RouterSync("t", PeerPlacements(Index(), lambda: []))
    a.open()
    b.open()
    b.connect(a.router_id, a.endpoint)
    return a, b


def _close(*syncs: RouterSync) -> None:
    for s in syncs:
        for sock in (s._pub, s._sub):
            sock.close(0)


def _placement(n: int) -> RequestInfo:
    return RequestInfo(block_hashes=[n, n + 1], num_tokens=64, block_size=32, request_id=f"q{n}")


def _wait_until_subscribed(a: RouterSync, b: RouterSync) -> None:
    """PUB drops what it sends before the subscription is in place: probe until one arrives."""
    for _ in range(200):
        a.publish(["bye", "nobody", "", ""])
        time.sleep(0.01)
        if b.drain():
            return
    raise AssertionError("the subscriber never connected")


def test_drain_applies_what_arrived_in_order_without_waiting():
    async def run():
        a, b = _pair()
        try:
            _wait_until_subscribed(a, b)
            for n in range(5):
                a.publish(routed_message(a.router_id, _placement(n), "r0", (0, 0, 0)))
            a.publish(["started", a.router_id, "q0", "r0"])
            a.publish(["done", a.router_id, "q1", "r0"])
            time.sleep(0.1)  # the loop never yields: only a synchronous drain can see these
            assert b.drain() == 7
            pending = b.placements.pending()
            # q1 was routed then done (in that order: applied the other way round it would count forever)
            assert pending == {"r0": [4, 1, 3 * 64]}
            assert b.drain() == 0  # nothing is applied twice
        finally:
            _close(a, b)

    asyncio.run(run())


def test_the_loop_applies_messages_as_they_arrive():
    async def run():
        a, b = _pair()
        b.read_when_ready(asyncio.get_running_loop())
        try:
            _wait_until_subscribed(a, b)
            a.publish(routed_message(a.router_id, _placement(7), "r1", (0, 0, 0)))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if b.placements.pending():
                    break
            assert b.placements.pending() == {"r1": [1, 0, 64]}
            assert b.first_peer_s is not None
            for n in range(3):  # several at once: one signal, all of them read
                a.publish(["started", a.router_id, "q7", "r1"] if n == 2 else ["bye", "nobody", "", ""])
            for _ in range(100):
                await asyncio.sleep(0.01)
                if b.placements.pending()["r1"][1]:
                    break
            assert b.placements.pending() == {"r1": [1, 1, 0]}
        finally:
            b.close()
            a.close()

    asyncio.run(run())


def test_what_one_turn_of_the_loop_publishes_leaves_as_one_frame_applied_in_order():
    async def run():
        a, b = _pair()
        try:
            _wait_until_subscribed(a, b)
            a.batch_on(asyncio.get_running_loop())
            frames = a.frames
            for n in range(4):
                a.publish(routed_message(a.router_id, _placement(n), "r0", (0, 0, 0)))
            a.publish(["done", a.router_id, "q1", "r0"])
            assert a.frames == frames  # nothing sent before the loop turns
            await asyncio.sleep(0)
            assert a.frames == frames + 1 and a.published >= 5
            a.publish(["started", a.router_id, "q0", "r0"])  # a later turn: a frame of its own
            await asyncio.sleep(0)
            assert a.frames == frames + 2
            time.sleep(0.1)
            assert b.drain() == 6  # the batch's five messages and the single one
            # q1 routed then done within the batch: applied in order, it no longer counts
            assert b.placements.pending() == {"r0": [3, 1, 2 * 64]}
        finally:
            _close(a, b)

    asyncio.run(run())


def test_without_the_channel_secret_there_is_no_placement_stream(monkeypatch):
    """In the clear, any local process could read the tenants' placements or inject its own."""
    monkeypatch.delenv(CHANNEL_SECRET_FILE_ENV)
    sync = RouterSync("t", PeerPlacements(Index(), lambda: []))
    with pytest.raises(ChannelError):
        sync.open()
    assert sync._pub is None and sync._sub is None


class _Sub:
    """The SUB socket's connections (kvmesh's use of it), recorded."""

    def __init__(self):
        self.connected: list[str] = []

    def connect(self, endpoint: str) -> None:
        self.connected.append(endpoint)

    def disconnect(self, endpoint: str) -> None:  # as ZMQ does: every connection to the endpoint goes
        self.connected = [e for e in self.connected if e != endpoint]


class _Registry:
    """The router registry's heartbeat, answering the peers set by the test (`calls`: heartbeats answered)."""

    def __init__(self):
        self.peers: dict[str, str] = {}
        self.calls = 0
        outer = self

        class _Heartbeat:
            async def remote(self, router: str, endpoint: str) -> dict[str, str]:
                outer.calls += 1
                return dict(outer.peers)

        self.heartbeat = _Heartbeat()


def test_a_router_restarted_on_a_departed_routers_port_stays_connected_once():
    """Discovery may learn at once that router A left and that router B, restarted on the port A freed,
    joined: B must end up subscribed, exactly once (two connections would deliver each message twice)."""

    async def run():
        sync = RouterSync("t", PeerPlacements(Index(), lambda: []), poll_s=0.01)
        sync._sub, sync._registry, sync.endpoint = _Sub(), _Registry(), "tcp://127.0.0.1:1"
        endpoint = "tcp://127.0.0.1:5000"
        sync.connect("A", endpoint)

        async def discover_until(check) -> None:
            task = asyncio.create_task(sync._discover())
            for _ in range(200):
                await asyncio.sleep(0.01)
                if check():
                    break
            task.cancel()

        sync._registry.peers = {"B": endpoint}
        await discover_until(lambda: "B" in sync.peers)
        assert sync.peers == {"B": endpoint} and sync._sub.connected == [endpoint]
        sync._registry.peers = {}
        await discover_until(lambda: not sync.peers)
        assert sync._sub.connected == []

    asyncio.run(run())


def test_discovery_cancelled_in_the_step_its_heartbeat_is_answered_ends():
    """The router closing cancels discovery; a cancel that comes in the loop step the registry's answer does
    must still end it (Python 3.11's `asyncio.wait_for` returns the answer and drops such a cancel: discovery
    would go on heartbeating for a router that is gone, and whoever awaits it would wait for ever)."""

    async def run():
        sync = RouterSync("t", PeerPlacements(Index(), lambda: []), poll_s=0.01)
        sync._sub, sync.endpoint = _Sub(), "tcp://127.0.0.1:1"
        answers: list[asyncio.Future] = []

        class _Heartbeat:
            def remote(self, router: str, endpoint: str) -> asyncio.Future:
                answers.append(asyncio.get_running_loop().create_future())
                return answers[-1]

        class _Pending:
            heartbeat = _Heartbeat()

        sync._registry = _Pending()
        task = asyncio.create_task(sync._discover())
        for _ in range(3):  # discovery reaches the wait for its first answer
            await asyncio.sleep(0)
        assert len(answers) == 1 and not task.done()
        answers[0].set_result({})
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        assert task in done and task.cancelled()
        assert len(answers) == 1  # no heartbeat after the cancel

    asyncio.run(run())


def test_a_router_that_closes_tells_its_peers_it_left_at_once():
    from kvmesh.cluster.index import PrefixIndex

    index = PrefixIndex(max_blocks=1000)
    index.add_replica("r0")
    a = RouterSync("t", PeerPlacements(index, lambda: []))
    b = RouterSync("t", PeerPlacements(index, lambda: []))
    a.open()
    b.open()
    b.connect(a.router_id, a.endpoint)
    try:
        _wait_until_subscribed(a, b)
        a.publish(routed_message(a.router_id, _placement(1), "r0", (0, 0, 0)))
        deadline = time.monotonic() + 5
        while not b.placements.pending() and time.monotonic() < deadline:
            b.drain()
            time.sleep(0.01)
        assert b.placements.pending()["r0"][0] == 1
        a.close()  # its `bye` leaves before the socket closes: the peer stops counting its load now,
        deadline = time.monotonic() + 2  # not a placement's time to live later
        while b.placements.pending() and time.monotonic() < deadline:
            b.drain()
            time.sleep(0.01)
        assert b.placements.pending() == {}
    finally:
        a.close()
        b.close()


def test_the_stream_drops_a_frozen_peer_and_bounds_what_it_queues_for_one():
    """A frozen peer (SIGSTOP, a paused VM) keeps its TCP connection: its PUB queue grew to the high-water
    mark of 100k frames, 1.7 GB of 2048-hash `routed` frames. ZMQ heartbeats now close its connection, and
    frames are capped in bytes so that a full queue stays within the stated budget."""
    import msgpack
    import zmq

    from kvmesh.deployments import router_sync

    a, b = _pair()
    try:
        for sock in (a._pub, a._sub):
            for option in (zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL):
                assert sock.getsockopt(option) > 0
        frame_max = router_sync.FRAME_MAX_BYTES
        assert a._pub.getsockopt(zmq.SNDHWM) * frame_max <= router_sync.STREAM_QUEUE_BUDGET_BYTES
        assert a._sub.getsockopt(zmq.RCVHWM) * frame_max <= router_sync.STREAM_QUEUE_BUDGET_BYTES
    finally:
        _close(a, b)

    class Pub:
        def __init__(self):
            self.frames: list[bytes] = []

        def send(self, frame: bytes, flags: int = 0) -> None:
            self.frames.append(frame)

    sync = RouterSync("t", PeerPlacements(Index(), lambda: []))
    sync._pub = Pub()
    hashes = list(range(2**62, 2**62 + 2048))  # a 32k-token prompt at 16-token blocks: ~18 KB a message
    sent = [
        routed_message(
            sync.router_id,
            RequestInfo(block_hashes=hashes, num_tokens=32768, block_size=16, request_id=f"q{n}"),
            "r0",
            (0, 0, 0),
        )
        for n in range(40)
    ]
    sent.insert(7, ["done", sync.router_id, "q0", "r0"])
    sync._outbox = list(sent)  # one turn of the loop's messages
    sync.flush()
    assert len(sync._pub.frames) > 1 and all(len(f) <= frame_max for f in sync._pub.frames)
    received = []
    for frame in sync._pub.frames:
        msg = msgpack.unpackb(frame)
        if msg[0] == "batch":
            assert frame == msgpack.packb(["batch", sync.router_id, "", "", msg[4]])
            received.extend(msg[4])
        else:
            received.append(msg)
    assert received == msgpack.unpackb(msgpack.packb(sent))  # every message, in order
    assert sync.published == len(sent) and sync.frames == len(sync._pub.frames)


def test_a_registry_made_again_empty_drops_no_peer_whose_stream_still_arrives():
    """The registry actor died with its node and was made again, empty: its first answer names no peer.
    Peer A's placements and its tenant's requests in flight stay while A's messages arrive (dropped, a
    tenant capped fleet-wide at N could run about 2N); once A has been silent for PEER_TTL_S and is still
    not listed, it is gone."""
    from kvmesh.deployments.router_sync import PEER_TTL_S

    async def run():
        now = [1000.0]
        peers = PeerPlacements(Index(), lambda: [])
        peers.monotonic = lambda: now[0]
        sync = RouterSync("t", peers, poll_s=0.001)
        sync._sub, sync._registry, sync.endpoint = _Sub(), _Registry(), "tcp://127.0.0.1:1"
        sync._registry.peers = {"A": "tcp://127.0.0.1:5000"}

        async def polls(n: int) -> None:  # let discovery take `n` more registry answers
            task = asyncio.create_task(sync._discover())
            calls = sync._registry.calls
            for _ in range(2000):
                await asyncio.sleep(0.001)
                if sync._registry.calls >= calls + n:
                    break
            task.cancel()

        await polls(1)
        assert sync.peers == {"A": "tcp://127.0.0.1:5000"}
        for n in range(2):
            info = RequestInfo(block_hashes=[n], num_tokens=64, block_size=32, request_id=f"q{n}", tenant="t1")
            peers.apply(routed_message("A", info, "r0", (0, 0, 0)))
        sync._registry.peers = {}  # made again: A has not heartbeated it yet
        await polls(2)
        assert len(peers.placements) == 2 and peers.tenants.active("t1") == 2
        assert sync.peers == {"A": "tcp://127.0.0.1:5000"} and sync._sub.connected == ["tcp://127.0.0.1:5000"]
        now[0] += PEER_TTL_S - 1
        peers.apply(["clock", "A", "", "", 1.0, {}])  # its clock message, every poll: still streaming
        now[0] += PEER_TTL_S - 1
        await polls(2)
        assert len(peers.placements) == 2 and peers.tenants.active("t1") == 2
        now[0] += PEER_TTL_S  # silent since, and still not listed: gone
        await polls(2)
        assert sync.peers == {} and sync._sub.connected == []
        assert peers.placements == {} and peers.tenants.active("t1") == 0

    asyncio.run(run())


def test_a_registry_that_never_answers_stops_no_upkeep():
    """The registry's node froze: its heartbeat never answers. Peers' placements still expire, and this
    router still names its requests in flight (`live`) and publishes its clock messages; the heartbeat is
    given up and tried again."""
    from kvmesh.deployments.router_sync import PLACEMENT_TTL_S

    class Hung:
        def __init__(self):
            self.calls = 0
            outer = self

            class _Heartbeat:
                def remote(self, router: str, endpoint: str):
                    outer.calls += 1
                    return asyncio.get_running_loop().create_future()  # never resolved

            self.heartbeat = _Heartbeat()

    async def run():
        now = [1000.0]
        peers = PeerPlacements(Index(), lambda: [])
        peers.monotonic = lambda: now[0]
        sync = RouterSync("t", peers, poll_s=0.001)
        sync.registry_timeout_s = 0.01
        sync._sub, sync._registry, sync.endpoint = _Sub(), Hung(), "tcp://127.0.0.1:1"
        sync.open = lambda: None  # type: ignore[method-assign]  # no sockets: what is sent is recorded
        sync.read_when_ready = lambda loop: None  # type: ignore[method-assign]
        sent: list[list] = []
        sync.publish = sent.append  # type: ignore[method-assign]
        sync.own_requests = lambda: ["mine"]
        sync.peers["B"] = "tcp://127.0.0.1:5000"
        peers.apply(routed_message("B", _placement(1), "r0", (0, 0, 0)))  # its `done` will be lost
        sync.start()
        try:
            for _ in range(2000):  # the first poll: the registry is asked, and hangs
                await asyncio.sleep(0.001)
                if sync._registry.calls and sent:
                    break
            now[0] += PLACEMENT_TTL_S + 1  # long past the placement's time to live and `live`'s period
            for _ in range(2000):
                await asyncio.sleep(0.001)
                kinds = [m[0] for m in sent]
                if not peers.placements and "live" in kinds and kinds.count("clock") >= 2 and sync._registry.calls >= 2:
                    break
            kinds = [m[0] for m in sent]
            assert peers.placements == {}
            assert "live" in kinds and kinds.count("clock") >= 2
            assert sync._registry.calls >= 2  # given up, and asked again
        finally:
            for task in sync._tasks:
                task.cancel()

    asyncio.run(run())

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
    """The router registry's heartbeat, answering the peers set by the test."""

    def __init__(self):
        self.peers: dict[str, str] = {}
        outer = self

        class _Heartbeat:
            async def remote(self, router: str, endpoint: str) -> dict[str, str]:
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

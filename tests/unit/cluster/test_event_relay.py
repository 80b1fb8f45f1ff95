"""The engine-side KV-event relay (cluster/event_relay.py): routing fields only, over CURVE, replay kept.

The upstream here is a plain ZMQ PUB sending vLLM's wire format ([topic, seq, msgpack batch]); the
relay against vLLM's own publisher is tests/integration/test_event_relay_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgpack
import pytest
import zmq

from kvmesh.cluster.event_relay import ROUTING_FIELDS, EventRelay, routing_payload
from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import DecodeError, KVEventSubscriber, decode_payload
from kvmesh.cluster.secure_channel import ChannelKeys, secure_client

KEYS = ChannelKeys.from_secret(b"relay-test-secret-0123456789")
TOKENS = [101, 202, 303, 404]


def stored(hashes, parent=None, tokens=TOKENS, salt="tenant-salt"):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": "secret-adapter",
        "extra_keys": [[["cache_salt", salt]]],
        "group_idx": 0,
    }


def batch(*events) -> bytes:
    return msgpack.packb([1.5, list(events), 0])


def test_routing_payload_keeps_what_routing_needs_and_drops_prompts():
    raw = batch(
        stored([11, 12], parent=10),
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "token_ids": TOKENS},
    )
    out = msgpack.unpackb(routing_payload(raw), raw=False)
    assert out[0] == 1.5 and out[2] == 0
    assert [e["type"] for e in out[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    for ev in out[1]:
        assert set(ev) <= {"type", *ROUTING_FIELDS[ev["type"]]}
        assert "token_ids" not in ev and "extra_keys" not in ev and "lora_name" not in ev
    assert out[1][0] == {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "block_size": 4,
        "medium": "GPU",
        "group_idx": 0,
    }
    assert b"tenant-salt" not in routing_payload(raw) and b"secret-adapter" not in routing_payload(raw)
    # what is left still decodes into the router's records
    assert [type(e).__name__ for e in decode_payload(routing_payload(raw)).events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]


def test_routing_payload_strips_the_older_array_form_too():
    raw = msgpack.packb([0.0, [["BlockStored", [7], None, TOKENS, 4, 3, "GPU", None, None, 0]], None])
    (ev,) = msgpack.unpackb(routing_payload(raw), raw=False)[1]
    kept = {"block_hashes": [7], "block_size": 4, "lora_id": 3, "medium": "GPU", "group_idx": 0}
    assert ev == {"type": "BlockStored", **kept}


def test_routing_payload_rejects_what_is_not_a_batch():
    with pytest.raises(DecodeError):
        routing_payload(b"\xc1")
    with pytest.raises(DecodeError):
        routing_payload(msgpack.packb({"not": "a batch"}))


class Upstream:
    """Stands in for vLLM's private publisher: a PUB bound on an ipc path, vLLM's frames, vLLM's high-water
    mark (100,000: a PUB drops past it, and a relay kept off the cores a while falls thousands behind)."""

    def __init__(self, path):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.endpoint = f"ipc://{path}"
        self.pub.bind(self.endpoint)

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart([b"kvmesh", seq.to_bytes(8, "big"), payload])

    def close(self):
        self.ctx.destroy(linger=0)


def wait_for(cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def relay(tmp_path):
    up = Upstream(tmp_path / "pub")
    r = EventRelay(up.endpoint, None, bind_host="127.0.0.1", keys=KEYS, topic="kvmesh")
    # the relay's SUB joins asynchronously: publish a first batch until it has arrived
    assert wait_for(lambda: (up.send(0, batch(stored([1]))), r.last_seq == 0)[1])
    yield up, r
    r.close()
    up.close()


def test_relay_forwards_without_token_ids_only_to_the_key_holder(relay):
    up, r = relay
    assert r.endpoint.startswith("tcp://127.0.0.1:") and r.replay_endpoint.startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.SUB)
        good = secure_client(ctx.socket(zmq.SUB), KEYS)
        for s in (plain, good):
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(r.endpoint)
        got = []
        seq = 1
        while len(got) < 5 and seq < 1500:  # the SUB joins asynchronously too
            up.send(seq, batch(stored([100 + seq], parent=99 + seq)))
            seq += 1
            while good.poll(20):
                got.append(good.recv_multipart())
        assert len(got) >= 5
        for topic, seq_b, payload in got:
            assert topic == b"kvmesh" and len(seq_b) == 8
            assert b"token_ids" not in payload and b"cache_salt" not in payload
            (ev,) = msgpack.unpackb(payload, raw=False)[1]
            assert ev["block_hashes"] == [100 + int.from_bytes(seq_b, "big")]
        assert not plain.poll(300)
    finally:
        ctx.destroy(linger=0)


def test_a_router_without_the_key_gets_no_replay(relay):
    _, r = relay
    ctx = zmq.Context()
    try:
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.SNDTIMEO, 2000)  # a refused DEALER can lose its pipe and block sending
        plain.connect(r.replay_endpoint)
        with contextlib.suppress(zmq.Again):  # refused before it could queue: it gets nothing either way
            plain.send_multipart([b"", (0).to_bytes(8, "big")])
        good = secure_client(ctx.socket(zmq.DEALER), KEYS)
        good.connect(r.replay_endpoint)
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        assert good.poll(10_000)
        first = good.recv_multipart()
        assert first[1:3] == [b"kvmesh", (0).to_bytes(8, "big")] and b"token_ids" not in first[3]
        assert not plain.poll(300)
    finally:
        ctx.destroy(linger=0)


def test_subscriber_catches_up_through_the_relays_replay_and_clears_on_a_batch_it_lost(relay):
    """A late router fetches history from the relay's buffer (exact); a batch the relay never got is
    a gap no replay can close, so the router clears the replica's view instead of trusting it."""
    up, r = relay
    for seq in range(1, 5):
        up.send(seq, batch(stored([1 + seq], parent=seq)))
    assert wait_for(lambda: r.last_seq == 4)

    async def scenario():
        index = PrefixIndex()
        index.add_replica("e0")
        sub = KVEventSubscriber(index, keys=KEYS, replay_timeout_s=2.0)
        try:
            await sub.add_source("e0", r.endpoint, topic="kvmesh", replay_endpoint=r.replay_endpoint, auth="curve")
            src = sub.sources["e0"]
            seq = 5
            while src.last_seq is None and seq < 400:  # the first batch that arrives triggers the replay
                up.send(seq, batch(stored([1 + seq], parent=seq)))
                seq += 1
                await asyncio.sleep(0.05)
            assert src.replays_ok == 1 and src.replays_failed == 0
            assert index.match([1, 2, 3, 4, 5])["e0"][0] == 5  # history from before the router joined
            while src.last_seq != seq - 1:  # drain what is still in flight
                await asyncio.sleep(0.02)
            up.send(seq + 1, batch(stored([777])))  # seq itself never reaches the relay
            for _ in range(500):
                if src.replays_failed:
                    break
                await asyncio.sleep(0.02)
            assert r.stats()["lost"] == 1
            assert src.replays_failed == 1 and index.match([1, 2])["e0"][0] == 0
            assert index.match([777])["e0"][0] == 1
        finally:
            await sub.close()

    asyncio.run(scenario())


def test_the_relays_thread_is_named_in_the_os(relay):
    """`top -H` on an engine replica tells the relay's CPU from vLLM's step thread and Serve's loop."""
    from kvmesh.cluster.thread_names import os_thread_name

    _, r = relay
    assert os_thread_name(r._thread.native_id) == "kvmesh-relay"


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


@pytest.mark.parametrize(
    "replayed",
    [{2: [stored([7])], 4: [stored([9])]}, {1: [stored([8])], 2: [stored([7])]}],
    ids=["a_hole_in_the_reply", "a_reply_cut_short"],
)
def test_a_replay_with_a_hole_applies_nothing_from_before_the_hole(replayed):
    """Batch 3 removed block 7, and the reply lacks it (the relay never got it, or the reply was cut short
    before it): applying batch 2 would index block 7 the engine no longer holds, a hit predicted that the
    engine cannot deliver. Only the unbroken run of batches up to the live one may be applied."""
    from kvmesh.cluster.kv_events import SourceState

    async def scenario():
        index = PrefixIndex()
        index.add_replica("e0")
        sub = KVEventSubscriber(index, keys=KEYS)
        try:
            src = SourceState("e0", "tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2")
            sub.sources["e0"] = src
            await sub._receive(src, [b"kvmesh", (0).to_bytes(8, "big"), batch(stored([1]))])

            async def fetch(source, start):
                return {s: batch(*events) for s, events in replayed.items()}

            sub._fetch_replay = fetch  # type: ignore[method-assign]
            await sub._receive(src, [b"kvmesh", (4).to_bytes(8, "big"), batch(stored([9]))])
            assert src.replays_failed == 1 and src.last_seq == 4
            assert index.match([7])["e0"][0] == 0 and index.match([9])["e0"][0] == 1
        finally:
            sub.sources.clear()  # made by hand, without a socket or a task
            await sub.close()

    asyncio.run(scenario())


def test_a_late_router_replays_the_relays_whole_buffer_of_large_batches(tmp_path):
    """A ROUTER drops what is past a peer's high-water mark without a word, the end marker included: a
    late router asking for a buffer of 8,000 batches of a few KB each got the first few thousand."""
    up = Upstream(tmp_path / "pub")
    r = EventRelay(up.endpoint, None, bind_host="127.0.0.1", keys=KEYS, topic="kvmesh")
    big = list(range(10_000, 10_400))  # 400 block hashes a batch: a long prefill's BlockStored
    try:
        assert wait_for(lambda: (up.send(0, batch(stored([1]))), r.last_seq == 0)[1])
        for seq in range(1, 8000):
            up.send(seq, batch(stored([seq * 1000 + h for h in big[:400]])))
        assert wait_for(lambda: r.last_seq == 7999)

        async def scenario():
            sub = KVEventSubscriber(PrefixIndex(), keys=KEYS, replay_timeout_s=5.0)
            try:
                await sub.add_source("e0", r.endpoint, topic="kvmesh", replay_endpoint=r.replay_endpoint, auth="curve")
                return await sub._fetch_replay(sub.sources["e0"], 0)
            finally:
                await sub.close()

        fetched = asyncio.run(scenario())
        assert sorted(fetched) == list(range(8000))
    finally:
        r.close()
        up.close()

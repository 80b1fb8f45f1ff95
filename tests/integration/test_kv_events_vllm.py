"""KV-event decoding and ingestion against REAL vLLM frames.

Frames are built with vLLM's own `KVEventBatch` / `BlockStored` / ... structs and msgspec encoder,
and in the socket tests sent by vLLM's own `ZmqEventPublisher` (PUB + ROUTER replay), so a change
in vLLM's wire format fails here. kvmesh's decoder itself never imports vLLM.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventApplier,
    KVEventSubscriber,
    SourceState,
    decode_frames,
    decode_payload,
)
from kvmesh.cluster.ports import free_port

kv = pytest.importorskip("vllm.distributed.kv_events", reason="vllm is a test dependency")
import msgspec  # noqa: E402  (after the importorskip: vLLM brings msgspec)

pytestmark = pytest.mark.integration  # the decoder is checked against vLLM's own event classes and publisher

_enc = msgspec.msgpack.Encoder()


def stored(hashes, medium="GPU", parent=None, **kw):
    return kv.BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **kw,
    )


def removed(hashes, medium="GPU", **kw):
    return kv.BlockRemoved(block_hashes=list(hashes), medium=medium, **kw)


def frames(seq, events, topic=b"kv"):
    payload = _enc.encode(kv.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
    return [topic, seq.to_bytes(8, "big"), payload]


def make_applier():
    idx = PrefixIndex()
    idx.add_replica("e0", "n0")
    idx.add_replica("e1", "n0")
    ap = KVEventApplier(idx)
    ap.sources["e0"] = SourceState("e0", "tcp://x:1")
    return idx, ap


def test_decode_real_vllm_batch_all_fields():
    h = [2**64 - 1, 12345]
    ev = stored(h, parent=77, extra_keys=[("salt-1",), None], group_idx=0)
    topic, seq, payload = decode_frames(frames(41, [ev, removed([5]), kv.AllBlocksCleared()]))
    assert (topic, seq) == (b"kv", 41)
    batch = decode_payload(payload)
    assert batch.data_parallel_rank == 0
    s, r, c = batch.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved) and isinstance(c, AllBlocksCleared)
    assert s.block_hashes == h and s.parent_block_hash == 77 and s.medium == "GPU"
    assert s.token_ids == list(range(32)) and s.block_size == 16
    assert s.extra_keys == [["salt-1"], None] and s.group_idx == 0
    assert r.block_hashes == [5]


def test_decode_array_form_and_unknown_event_types():
    import msgpack

    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [1, 2], None, [0] * 32, 16, None, "GPU"],
                {"type": "SomethingNew", "x": 1},
                ["BlockRemoved", [2], None],
            ],
        ]
    )
    events = decode_payload(payload).events
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].block_hashes == [1, 2] and events[1].block_hashes == [2]


def test_malformed_input_is_a_decode_error():
    with pytest.raises(DecodeError):
        decode_payload(b"\xc1not msgpack")
    with pytest.raises(DecodeError):
        decode_payload(_enc.encode({"a": 1}))
    with pytest.raises(DecodeError):
        decode_frames([b"kv", b"\x00\x01", b""])


def test_events_update_index_per_tier():
    idx, ap = make_applier()
    assert ap.handle("e0", frames(0, [stored([1, 2, 3]), stored([4], medium="CPU")])) == "next"
    m = idx.match([1, 2, 3, 4])
    assert m["e0"] == (3, 4, 4)
    assert m["e1"] == (0, 1 - 1, 0)  # host tier of n0 holds only block 4: no prefix for e1
    ap.handle("e0", frames(1, [removed([2])]))
    assert idx.match([1, 2, 3])["e0"] == (1, 1, 1)
    ap.handle("e0", frames(2, [kv.AllBlocksCleared()]))
    assert idx.match([1])["e0"] == (0, 0, 0)
    assert idx.stats["events_applied"] == 4
    assert ap.sources["e0"].batches == 3 and ap.sources["e0"].blocks == 5


def test_other_kv_cache_groups_and_unknown_media_are_ignored():
    idx, ap = make_applier()
    ap.handle("e0", frames(0, [stored([1], group_idx=1), stored([1], medium="NVME-X")]))
    assert idx.match([1])["e0"] == (0, 0, 0)
    assert idx.stats["events_ignored"] == 2


def test_bytes_hashes_use_low_64_bits():
    idx, ap = make_applier()
    full = bytes(range(32))
    ap.handle("e0", frames(0, [stored([full])]))
    assert idx.match([int.from_bytes(full[-8:], "big")])["e0"] == (1, 1, 1)


def test_gap_without_replay_clears_view_then_resumes():
    idx, ap = make_applier()
    ap.handle("e0", frames(0, [stored([1, 2])]))
    # batches 1..2 lost (one of them may have removed block 2): view must not keep stale blocks
    assert ap.handle("e0", frames(3, [stored([9])])) == "gap"
    m = idx.match([1])
    assert m["e0"] == (0, 0, 0)
    assert idx.match([9])["e0"] == (1, 1, 1)
    assert ap.sources["e0"].gaps == 1 and idx.stats["replicas_stale"] == 1
    assert not idx.is_stale("e0")  # resumed from the batch after the gap
    assert ap.handle("e0", frames(4, [stored([10])])) == "next"


def test_duplicates_are_skipped_and_late_join_keeps_events():
    idx, ap = make_applier()
    assert ap.handle("e0", frames(5, [stored([1])])) == "gap"  # joined late: nothing to clear
    assert idx.stats["replicas_stale"] == 0
    assert ap.handle("e0", frames(5, [removed([1])])) == "duplicate"
    assert idx.match([1])["e0"] == (1, 1, 1)


# ---------------------------------------------------------------- real sockets, vLLM's publisher
async def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def batch(events):
    return kv.KVEventBatch(ts=time.time(), events=events)


async def publish_until_seen(pub, sub, rid, events):
    """PUB/SUB drops messages until the subscription propagates: resend a probe until one lands."""
    while sub.sources[rid].last_seq is None:
        pub.publish(batch(events))
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("publisher_binds", [True, False])
def test_real_zmq_publisher_to_subscriber(publisher_binds):
    port = free_port()
    if publisher_binds:
        pub_ep, sub_ep, sub_bind = f"tcp://*:{port}", f"tcp://127.0.0.1:{port}", False
    else:
        pub_ep, sub_ep, sub_bind = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", True

    async def main():
        idx = PrefixIndex()
        idx.add_replica("e0")
        sub = KVEventSubscriber(idx)
        pub = None
        try:
            if sub_bind:  # the subscriber must be listening before the publisher connects
                await sub.add_source("e0", sub_ep, bind=True, topic="kv")
                pub = kv.ZmqEventPublisher(0, endpoint=pub_ep, topic="kv")
            else:
                pub = kv.ZmqEventPublisher(0, endpoint=pub_ep, topic="kv")
                await sub.add_source("e0", sub_ep, topic="kv")
            await publish_until_seen(pub, sub, "e0", [stored([1])])
            src = sub.sources["e0"]
            first = src.last_seq
            pub.publish(batch([stored([2, 3])]))
            pub.publish(batch([removed([3])]))
            await wait_for(lambda: src.last_seq == first + 2)
            assert idx.match([1, 2, 3])["e0"] == (2, 2, 2)
            assert src.batches == 3 and src.blocks == 4 and src.duplicates == 0
            assert idx.stats["replicas_stale"] == 0  # a late join is not a loss
        finally:
            await sub.close()
            if pub is not None:
                pub.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_real_publisher_replay_recovers_missed_batches():
    port, rport = free_port(), free_port()

    async def main():
        idx = PrefixIndex()
        idx.add_replica("e0")
        pub = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}", topic="kv")
        sub = KVEventSubscriber(idx, replay_timeout_s=2.0)
        try:
            # published before anyone subscribed: PUB drops them, only the replay buffer has them
            pub.publish(batch([stored([1, 2, 3])]))
            pub.publish(batch([removed([3])]))
            await asyncio.sleep(0.3)
            await sub.add_source(
                "e0", f"tcp://127.0.0.1:{port}", topic="kv", replay_endpoint=f"tcp://127.0.0.1:{rport}"
            )
            await publish_until_seen(pub, sub, "e0", [stored([7])])
            src = sub.sources["e0"]
            assert src.replays_ok == 1 and src.gaps == 1
            assert idx.match([1, 2, 3])["e0"] == (2, 2, 2)  # batches 0 and 1 came by replay
            # a later loss inside the stream: pretend batches after seq k were dropped
            k = src.last_seq
            pub.publish(batch([stored([4])]))
            await wait_for(lambda: src.last_seq == k + 1)
            src.last_seq = k - 1  # we "lost" batch k..k+1; the next one triggers a replay
            pub.publish(batch([stored([5])]))
            await wait_for(lambda: src.last_seq == k + 2)
            assert src.replays_ok == 2 and src.gaps == 2 and idx.stats["replicas_stale"] == 0
            assert idx.match([4])["e0"] == (1, 1, 1) and idx.match([5])["e0"] == (1, 1, 1)
        finally:
            await sub.close()
            pub.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_replay_unreachable_falls_back_to_clear():
    port, dead = free_port(), free_port()

    async def main():
        idx = PrefixIndex()
        idx.add_replica("e0")
        pub = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic="kv")
        sub = KVEventSubscriber(idx, replay_timeout_s=0.3)
        try:
            await sub.add_source("e0", f"tcp://127.0.0.1:{port}", topic="kv", replay_endpoint=f"tcp://127.0.0.1:{dead}")
            await publish_until_seen(pub, sub, "e0", [stored([1])])
            src = sub.sources["e0"]
            k, gaps0, failed0 = src.last_seq, src.gaps, src.replays_failed
            idx.store("e0", [1, 8])
            src.last_seq = k - 1  # pretend batch k was lost: the next one is a gap
            pub.publish(batch([stored([2])]))
            await wait_for(lambda: src.last_seq == k + 1)
            assert src.gaps == gaps0 + 1 and src.replays_failed == failed0 + 1
            assert idx.stats["replicas_stale"] == 1
            assert idx.match([8])["e0"] == (0, 0, 0)  # view cleared, not trusted
            assert idx.match([2])["e0"] == (1, 1, 1)
        finally:
            await sub.close()
            pub.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_decoder_does_not_import_vllm():
    import subprocess

    code = "import sys, kvmesh.cluster.kv_events, kvmesh.cluster.index; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_malformed_messages_on_the_socket_do_not_end_the_stream():
    import zmq

    port = free_port()

    async def main():
        idx = PrefixIndex()
        idx.add_replica("e0")
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        sub = KVEventSubscriber(idx)
        try:
            await sub.add_source("e0", f"tcp://127.0.0.1:{port}", topic="kv")
            src = sub.sources["e0"]
            seq = 0
            while src.last_seq is None:
                pub.send_multipart(frames(seq, [stored([1])]))
                seq += 1
                await asyncio.sleep(0.05)
            pub.send_multipart([b"kv", b"\x00"])  # wrong shape
            pub.send_multipart([b"kv", (seq).to_bytes(8, "big"), b"\xc1\xc1"])  # undecodable payload
            pub.send_multipart(frames(seq + 1, [stored([2])]))
            await wait_for(lambda: src.last_seq == seq + 1)
            assert src.decode_errors == 2
            assert idx.match([2])["e0"] == (1, 1, 1)
        finally:
            await sub.close()
            pub.close()
            ctx.term()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_replay_buffer_too_short_rebuilds_from_what_it_still_has():
    port, rport = free_port(), free_port()

    async def main():
        idx = PrefixIndex()
        idx.add_replica("e0")
        pub = kv.ZmqEventPublisher(
            0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}", topic="kv", buffer_steps=3
        )
        sub = KVEventSubscriber(idx, replay_timeout_s=1.0)
        try:
            for h in (10, 11, 12, 13):  # nobody listening; the buffer keeps only the last 3 batches
                pub.publish(batch([stored([h])]))
            await asyncio.sleep(0.3)
            await sub.add_source(
                "e0", f"tcp://127.0.0.1:{port}", topic="kv", replay_endpoint=f"tcp://127.0.0.1:{rport}"
            )
            await publish_until_seen(pub, sub, "e0", [stored([7])])
            src = sub.sources["e0"]
            assert src.gaps == 1 and src.replays_failed == 1 and src.replays_ok == 0
            assert idx.stats["replicas_stale"] == 0  # a late join had nothing to clear
            assert idx.match([10])["e0"] == (0, 0, 0)  # fell out of the buffer: unknown
            assert idx.match([7])["e0"] == (1, 1, 1)
            # later batches keep flowing in order
            k = src.last_seq
            pub.publish(batch([stored([8])]))
            await wait_for(lambda: src.last_seq == k + 1)
            assert idx.match([8])["e0"] == (1, 1, 1) and src.gaps == 1
        finally:
            await sub.close()
            pub.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))

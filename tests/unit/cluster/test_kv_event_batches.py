"""A KV-event batch that cannot be applied is a lost batch: counted, passed, and the replica's view rebuilt from
what follows, with or without a replay endpoint. Held back instead, every later batch looked like a gap whose
replay failed on it again, and the replica's view froze for good (blocks removed still counted as hits)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import KVEventSubscriber, SourceState


def _batch(*events) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


def _stored(*hashes):
    return {"type": "BlockStored", "block_hashes": list(hashes)}


BAD = [
    {"type": "BlockStored"},  # no block_hashes
    {"type": "BlockStored", "block_hashes": ["x"]},  # a hash of the wrong type
    {"type": "BlockStored", "block_hashes": 7},  # not a list
]


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
@pytest.mark.parametrize("bad", BAD, ids=["missing", "str-hash", "int-hashes"])
def test_a_batch_that_cannot_be_applied_is_passed_and_the_view_rebuilt(replay, bad):
    async def run():
        index = PrefixIndex()
        index.add_replica("e0")
        sub = KVEventSubscriber(index)
        src = SourceState("e0", "ipc://unused", replay_endpoint="ipc://unused-replay" if replay else None)
        sub.sources["e0"] = src
        sent: dict[int, bytes] = {}

        async def replay_from(source, start):  # the relay's buffer: every batch it published
            return {s: p for s, p in sent.items() if s >= start}

        sub._fetch_replay = replay_from
        batches = [
            _batch(_stored(1, 2)),
            _batch(_stored(50), bad),
            _batch({"type": "BlockRemoved", "block_hashes": [1]}),
            _batch(_stored(900)),
        ]
        for seq, payload in enumerate(batches):
            sent[seq] = payload
            await sub._receive(src, [b"", seq.to_bytes(8, "big"), payload])
        assert src.last_seq == 3 and src.decode_errors == 1
        assert index.match([1])["e0"][0] == 0  # removed by the engine: no phantom hit
        assert index.match([900])["e0"][0] == 1  # stored after the bad batch: seen
        assert index.match([50])["e0"][0] == 0  # the bad batch's own events are not trusted
        assert src.replays_failed == 0
        sub.sources.clear()  # no socket or task was started for it
        await sub.close()

    asyncio.run(run())

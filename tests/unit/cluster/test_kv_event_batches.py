"""A KV-event batch that cannot be applied is a lost batch: counted, passed, and the replica's view rebuilt from
what follows, with or without a replay endpoint. Held back instead, every later batch looked like a gap whose
replay failed on it again, and the replica's view froze for good (blocks removed still counted as hits)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import RESTART_DROP, KVEventApplier, KVEventSubscriber, SourceState


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


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


async def _subscriber(replay: bool = True):
    index = PrefixIndex()
    index.add_replica("e0")
    sub = KVEventSubscriber(index)
    src = SourceState("e0", "ipc://unused", replay_endpoint="ipc://unused-replay" if replay else None)
    sub.sources["e0"] = src
    return index, sub, src


class _Watch:
    """A task that runs whenever the loop does, counting its turns that saw the source part-way through
    `n` batches. Counts loop turns, not time: the same on a loaded machine as on an idle one."""

    def __init__(self, src: SourceState, n: int) -> None:
        self.src, self.n, self.partway, self.done = src, n, 0, False
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self.done:
            if 0 < self.src.batches < self.n:
                self.partway += 1
            await asyncio.sleep(0)

    async def stop(self) -> None:
        self.done = True
        await self.task


N_BATCHES = 10_000


def test_a_replay_of_many_batches_lets_the_loop_run_and_applies_them_in_order():
    """A late join replays the engine's whole buffer (10_000 batches): applied in one go it froze the
    router's loop (its rankings) for ~0.4 s. Now the loop runs at least every `yield_every` batches."""

    async def run():
        index, sub, src = await _subscriber()
        payloads = {s: _batch(_stored(s), {"type": "BlockRemoved", "block_hashes": [s - 1]}) for s in range(N_BATCHES)}
        live = _batch(_stored(N_BATCHES))

        async def replay_from(source, start):
            await asyncio.sleep(0)  # the round trip
            return {s: p for s, p in payloads.items() if s >= start}

        sub._fetch_replay = replay_from
        watch = _Watch(src, N_BATCHES + 1)
        await sub._receive(src, _frames(N_BATCHES, live))  # late join: first seq heard is N_BATCHES
        await watch.stop()
        assert src.last_seq == N_BATCHES and src.batches == N_BATCHES + 1 and src.replays_ok == 1
        # in order: each batch removed the block the one before stored, so exactly the last two remain
        assert index.held_blocks("e0") == 2 and index.match([N_BATCHES - 1])["e0"][0] == 1
        assert watch.partway >= N_BATCHES // 100, watch.partway  # the loop ran every 100 batches or sooner
        assert sub.yields >= N_BATCHES // 100
        sub.sources.clear()
        await sub.close()

    asyncio.run(run())


def test_a_replay_stops_applying_when_the_replica_is_deregistered_meanwhile():
    async def run():
        index, sub, src = await _subscriber()
        payloads = {s: _batch(_stored(s)) for s in range(N_BATCHES)}

        async def replay_from(source, start):
            return {s: p for s, p in payloads.items() if s >= start}

        async def deregister():
            while src.batches < 100:
                await asyncio.sleep(0)
            index.remove_replica("e0")

        sub._fetch_replay = replay_from
        gone = asyncio.get_running_loop().create_task(deregister())
        await sub._receive(src, _frames(N_BATCHES, _batch(_stored(N_BATCHES))))
        await gone
        assert src.batches < N_BATCHES and src.decode_errors == 0
        sub.sources.clear()
        await sub.close()

    asyncio.run(run())


class _QueuedSocket:
    """A SUB socket holding a backlog: pyzmq hands back each queued message as a finished future (awaiting it
    does not suspend), then waits for the next one."""

    def __init__(self, messages: list[list[bytes]]) -> None:
        self.messages = list(reversed(messages))

    def recv_multipart(self):
        fut = asyncio.get_running_loop().create_future()
        if self.messages:
            fut.set_result(self.messages.pop())
        return fut  # else never done: nothing more was published

    def close(self, linger=0) -> None:
        pass


def test_draining_a_backlog_of_batches_lets_the_loop_run():
    """A backlog queued while the loop was busy (a GC pause, a slow ranking) was drained in one tick: 20_000
    batches held the loop 0.7 s."""

    async def run():
        index, sub, src = await _subscriber(replay=False)
        src._sock = _QueuedSocket([_frames(s, _batch(_stored(s))) for s in range(N_BATCHES)])
        watch = _Watch(src, N_BATCHES)
        src._task = asyncio.get_running_loop().create_task(sub._run(src))
        while src.batches < N_BATCHES:
            await asyncio.sleep(0)
        await watch.stop()
        assert src.last_seq == N_BATCHES - 1 and src.gaps == 0 and src.duplicates == 0
        assert index.held_blocks("e0") == N_BATCHES
        assert watch.partway >= N_BATCHES // 100, watch.partway
        await sub.close()

    asyncio.run(run())


def test_a_publisher_restarted_under_the_same_source_replaces_the_view():
    """An engine restarted under the same source id numbers its batches from 0 again: taken for duplicates
    they were dropped until the numbers passed the old ones, while the dead engine's blocks stayed."""

    async def run():
        index, sub, src = await _subscriber()
        sent: dict[int, bytes] = {}

        async def replay_from(source, start):
            return {s: p for s, p in sent.items() if s >= start}

        sub._fetch_replay = replay_from
        for seq in range(500):
            sent[seq] = _batch(_stored(1, 2, 3)) if seq == 0 else _batch()
            await sub._receive(src, _frames(seq, sent[seq]))
        assert index.match([1, 2, 3])["e0"][0] == 3
        await sub._receive(src, _frames(498, sent[498]))  # a genuine duplicate: skipped, the view kept
        assert src.duplicates == 1 and index.match([1, 2, 3])["e0"][0] == 3
        sent.clear()
        for seq in range(5):  # the new engine: empty cache, seq from 0
            sent[seq] = _batch(_stored(7, 8)) if seq == 0 else _batch()
            await sub._receive(src, _frames(seq, sent[seq]))
        assert index.match([1, 2, 3])["e0"][0] == 0
        assert index.match([7, 8])["e0"][0] == 2
        assert src.restarts == 1 and src.last_seq == 4 and src.duplicates == 1 and src.gaps == 0
        assert not index.is_stale("e0")
        assert sub.stats()["e0"]["restarts"] == 1
        sub.sources.clear()
        await sub.close()

    asyncio.run(run())


def test_a_restart_first_heard_past_seq_0_is_a_late_join_into_the_new_stream():
    """The restarted publisher's first batches may be missed (the SUB reconnecting): a drop of more than
    RESTART_DROP is a restart too, and the new engine's buffer is replayed from 0."""

    async def run():
        index, sub, src = await _subscriber()
        old = RESTART_DROP + 50
        src.last_seq = old - 1
        index.store("e0", [1, 2, 3])
        await sub._receive(src, _frames(old, _batch()))
        new = {0: _batch(_stored(7, 8)), 1: _batch(), 2: _batch(_stored(9))}

        async def replay_from(source, start):
            return {s: p for s, p in new.items() if s >= start}

        sub._fetch_replay = replay_from
        await sub._receive(src, _frames(2, new[2]))
        assert src.restarts == 1 and src.last_seq == 2
        assert index.match([1, 2, 3])["e0"][0] == 0 and index.match([7, 8])["e0"][0] == 2
        assert index.match([9])["e0"][0] == 1
        await sub._receive(src, _frames(1, new[1]))  # a duplicate of the new stream
        assert src.duplicates == 1 and src.restarts == 1
        sub.sources.clear()
        await sub.close()

    asyncio.run(run())


def test_the_applier_without_replay_takes_a_restart_too():
    index = PrefixIndex()
    index.add_replica("e0")
    ap = KVEventApplier(index)
    ap.sources["e0"] = src = SourceState("e0", "ipc://unused")
    assert ap.handle("e0", _frames(0, _batch(_stored(1, 2, 3)))) == "next"
    for seq in range(1, 10):
        assert ap.handle("e0", _frames(seq, _batch())) == "next"
    assert ap.handle("e0", _frames(7, _batch(_stored(99)))) == "duplicate"
    assert ap.handle("e0", _frames(0, _batch(_stored(7, 8)))) == "next"
    assert src.restarts == 1 and index.match([1, 2, 3])["e0"][0] == 0 and index.match([7, 8])["e0"][0] == 2
    assert index.match([99])["e0"][0] == 0

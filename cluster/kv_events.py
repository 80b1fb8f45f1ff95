"""vLLM KV-event ingestion: decode ZMQ frames with msgpack and apply them to a PrefixIndex.

Why not vLLM's own decoder: the router runs in the ingress process, which must stay light (no
torch, no vLLM import). The wire format of `vllm/distributed/kv_events.py` (0.32) is small:

    frames  = [topic, seq (8-byte big-endian), payload]
    payload = msgpack [ts, [event, ...], dp_rank]       (KVEventBatch, msgspec array_like)
    event   = map {"type": "BlockStored"|"BlockRemoved"|"AllBlocksCleared", field: value, ...}

(older vLLMs sent events as arrays `[tag, field, ...]`; both decode). Block hashes are uint64 (the
default VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or bytes, normalised by `PrefixIndex`.

Sequence numbers detect loss. A gap means some BlockRemoved may be missing, so the replica's view
could claim blocks it no longer has. If the engine runs a replay endpoint (vLLM
`KVEventsConfig.replay_endpoint`, a ROUTER socket) we fetch the missed batches and stay exact;
otherwise (or if the replay buffer no longer reaches back) the replica's view is cleared
(`PrefixIndex.mark_stale`) and rebuilt from what the buffer still holds and the following events:
an under-estimate, never a phantom hit.

Bind or connect: vLLM's publisher BINDS when its endpoint has `*`, `::` or is ipc/inproc, and
CONNECTS for a concrete address. Deployments should let engines bind (`tcp://*:PORT`) and have
every router connect to `tcp://ENGINE_IP:PORT` — a PUB fans out to any number of routers (one per
ingress replica). `bind=True` supports the other direction (engine given `tcp://ROUTER_IP:PORT`).

kvmesh's engines do not expose vLLM's publisher: `cluster/event_relay.py` republishes it without token
ids over ZMQ CURVE, and a source added with `auth="curve"` connects with the deployment's channel keys
(`cluster/secure_channel.py`), to the stream and to its replay endpoint alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

log = logging.getLogger(__name__)

END_SEQ = (1 << 64) - 1  # vLLM's replay end marker: (-1).to_bytes(8, "big", signed=True)
# a sequence number this far below the last one applied is a restarted publisher, not a late duplicate: a
# duplicate is at most a replay buffer's length behind (vLLM's and the relay's hold 10_000 batches)
RESTART_DROP = 100_000


class BlockStored(NamedTuple):
    block_hashes: list
    parent_block_hash: Any = None
    token_ids: list | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None
    locality: str | None = None


class BlockRemoved(NamedTuple):
    block_hashes: list
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(NamedTuple):
    pass


class EventBatch(NamedTuple):
    ts: float
    events: list
    data_parallel_rank: int | None = None


_TYPES: dict[str, type[BlockStored | BlockRemoved | AllBlocksCleared]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_FIELDS = {name: set(cls._fields) for name, cls in _TYPES.items()}
# positional order of the array (older) form, as declared in vLLM's structs
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


class DecodeError(ValueError):
    """A frame that is not a vLLM KV-event message."""


def _decode_event(raw: Any):
    if isinstance(raw, dict):
        kind = raw.get("type")
        cls = _TYPES.get(kind) if isinstance(kind, str) else None
        if kind is None or cls is None:
            return None  # an event type this version does not know: skip it
        names = _FIELDS[kind]
        return cls(**{k: v for k, v in raw.items() if k in names})
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        cls = _TYPES.get(kind)
        if cls is None:
            return None
        return cls(**dict(zip(_ARRAY_FIELDS[kind], raw[1:])))
    raise DecodeError(f"malformed KV event: {raw!r:.80}")


def unpack_batch(payload: bytes) -> tuple[Any, list, Any]:
    """vLLM's msgpack payload `[ts, [events], dp_rank]` -> (ts, the raw events, dp_rank or None), checked."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types
        raise DecodeError(f"undecodable KV-event payload: {exc}") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], list):
        raise DecodeError("KV-event payload is not [ts, [events], dp_rank]")
    return obj[0], obj[1], obj[2] if len(obj) > 2 else None


def decode_payload(payload: bytes) -> EventBatch:
    """msgpack payload -> EventBatch of decoded events (unknown event types are dropped)."""
    ts, raw, dp_rank = unpack_batch(payload)
    return EventBatch(ts, [e for e in map(_decode_event, raw) if e is not None], dp_rank)


def decode_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """[topic, seq, payload] -> (topic, seq, payload) with the sequence number as an int."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise DecodeError(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


@dataclass
class SourceState:
    """One engine's event stream."""

    replica_id: str
    endpoint: str
    bind: bool = False
    topic: str = ""
    replay_endpoint: str | None = None
    auth: str | None = None  # "curve": the engine's relay, reached with the deployment's channel keys
    last_seq: int | None = None
    batches: int = 0
    blocks: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    decode_errors: int = 0
    restarts: int = 0
    _task: Any = field(default=None, repr=False)
    _sock: Any = field(default=None, repr=False)


class KVEventApplier:
    """Sequence tracking + index updates, without sockets (the subscriber's testable core)."""

    def __init__(self, index) -> None:
        self.index = index
        self.sources: dict[str, SourceState] = {}

    def expected(self, src: SourceState) -> int:
        return 0 if src.last_seq is None else src.last_seq + 1

    def classify(self, src: SourceState, seq: int) -> str:
        """'next', 'duplicate', 'gap' or 'restart' for an incoming sequence number.

        'restart': seq 0 after later batches, or a drop of more than RESTART_DROP: the publisher started
        again under the same source (its engine restarted, its cache empty). Taken for duplicates, its
        batches were all dropped until its numbers passed the old ones, while the dead engine's blocks
        stayed in the index."""
        exp = self.expected(src)
        if seq == exp:
            return "next"
        if seq < exp:
            if src.last_seq and (seq == 0 or src.last_seq - seq > RESTART_DROP):
                return "restart"
            return "duplicate"
        return "gap"

    def restart(self, src: SourceState, seq: int) -> str:
        """A restarted publisher: forget the replica's view and its sequence, then classify `seq` afresh
        ('next' for seq 0, else 'gap': a late join into the new stream)."""
        src.restarts += 1
        log.warning(
            "replica %s: KV-event sequence restarted (%d after %d): its view is rebuilt",
            src.replica_id,
            seq,
            src.last_seq,
        )
        if self.index.has_replica(src.replica_id):
            self.index.mark_stale(src.replica_id)
            self.index.mark_fresh(src.replica_id)
        src.last_seq = None
        return self.classify(src, seq)

    def apply(self, src: SourceState, seq: int, payload: bytes) -> int:
        """Decode and apply one batch; returns blocks touched (0 for a batch that cannot be applied).

        A batch that fails to decode or to apply (a malformed event: a missing field, a hash of the wrong
        type) is a lost batch: counted, its sequence number passed, and the replica's view cleared to be
        rebuilt from what follows (it may have removed blocks, and events before the bad one may be
        applied already). Not passing it would make every later batch a gap whose replay fails on it
        again, and freeze the replica's view for good."""
        try:
            batch = decode_payload(payload)
            self.index.apply_events(src.replica_id, batch.events)
        except Exception as exc:
            src.decode_errors += 1
            log.warning("replica %s: KV-event batch %d lost (%r): its view is rebuilt", src.replica_id, seq, exc)
            src.last_seq = seq
            if self.index.has_replica(src.replica_id):
                self.index.mark_stale(src.replica_id)
                self.index.mark_fresh(src.replica_id)  # rebuilt from the next batch on, as after a gap
            return 0
        src.last_seq = seq
        src.batches += 1
        n = sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllBlocksCleared))
        src.blocks += n
        return n

    def resync_fresh(self, src: SourceState) -> None:
        """Lost events we cannot recover: forget this replica's view, rebuild from what follows."""
        self.index.mark_stale(src.replica_id)

    def handle(self, replica_id: str, frames: list[bytes]) -> str:
        """Apply one received message without replay (gap -> clear and resume). Returns its class."""
        src = self.sources[replica_id]
        _, seq, payload = decode_frames(frames)
        kind = self.classify(src, seq)
        if kind == "restart":
            kind = self.restart(src, seq)
        if kind == "duplicate":
            src.duplicates += 1
            return kind
        if kind == "gap":
            src.gaps += 1
            if src.last_seq is not None:  # a late join (first seq > 0) has nothing to clear
                self.resync_fresh(src)
        self.apply(src, seq, payload)
        if kind == "gap":
            self.index.mark_fresh(replica_id)
        return kind


class _Pace:
    """Yields to the event loop every `every` batches or `slice_s` of work. Why: pyzmq hands back a message
    already queued as a finished future, and awaiting one does not suspend, so a backlog or a replay of
    thousands of batches was applied in one tick, with every routing decision (same loop) waiting for it."""

    __slots__ = ("every", "slice_s", "n", "t0", "yields")

    def __init__(self, every: int, slice_s: float) -> None:
        self.every, self.slice_s = every, slice_s
        self.yields = 0
        self.restart()

    def restart(self) -> None:
        """The loop just ran other tasks (a real wait): a new slice begins."""
        self.n, self.t0 = 0, time.perf_counter()

    async def step(self) -> None:
        """One batch done: yield if this slice is used up."""
        self.n += 1
        if self.n >= self.every or time.perf_counter() - self.t0 >= self.slice_s:
            self.yields += 1
            await asyncio.sleep(0)
            self.restart()


class KVEventSubscriber(KVEventApplier):
    """asyncio SUB sockets, one per engine replica, feeding a PrefixIndex in the same loop."""

    # batches applied at most between two yields to the loop, and the work at most (`_Pace`)
    yield_every = 64
    yield_after_s = 0.001

    def __init__(self, index, *, replay_timeout_s: float = 2.0, ctx=None, keys=None):
        super().__init__(index)
        self._keys = keys  # ChannelKeys for auth="curve" sources; loaded from the environment when first needed
        import zmq.asyncio

        self._zmq = __import__("zmq")
        # our own context: Context.instance() may hand back a sync singleton created by someone else
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self.replay_timeout_s = replay_timeout_s
        self.yields = 0  # yields to the loop amid a backlog or a replay (`_Pace`)

    async def add_source(
        self,
        replica_id: str,
        endpoint: str,
        *,
        bind: bool = False,
        topic: str = "",
        replay_endpoint: str | None = None,
        auth: str | None = None,
    ) -> str:
        """Start receiving a replica's events; returns the endpoint actually bound/connected."""
        zmq = self._zmq
        if auth not in (None, "curve"):
            raise ValueError(f"unknown KV-event stream auth {auth!r}")
        if replica_id in self.sources:
            await self.remove_source(replica_id)
        sock = self._secure(self._ctx.socket(zmq.SUB), auth)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        if bind:
            sock.bind(endpoint)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sock.connect(endpoint)
        src = SourceState(replica_id, endpoint, bind, topic, replay_endpoint, auth, _sock=sock)
        self.sources[replica_id] = src
        src._task = asyncio.get_running_loop().create_task(self._run(src), name=f"kv-events-{replica_id}")
        return endpoint

    def _secure(self, sock, auth: str | None):
        if auth == "curve":
            from kvmesh.cluster.secure_channel import channel_keys, secure_client

            if self._keys is None:
                self._keys = channel_keys()
            secure_client(sock, self._keys)
        return sock

    async def remove_source(self, replica_id: str) -> None:
        src = self.sources.pop(replica_id, None)
        if src is None:
            return
        src._task.cancel()
        try:
            await src._task
        except (asyncio.CancelledError, Exception):
            pass
        src._sock.close(linger=0)

    async def close(self) -> None:
        for rid in list(self.sources):
            await self.remove_source(rid)
        if self._own_ctx:
            self._ctx.term()

    def stats(self) -> dict[str, dict[str, int]]:
        keys = ("batches", "blocks", "duplicates", "gaps", "replays_ok", "replays_failed", "decode_errors", "restarts")
        return {rid: {k: getattr(s, k) for k in keys} | {"last_seq": s.last_seq} for rid, s in self.sources.items()}

    def _pace(self) -> _Pace:
        return _Pace(self.yield_every, self.yield_after_s)

    async def _run(self, src: SourceState) -> None:
        pace = self._pace()
        while True:
            pending = src._sock.recv_multipart()
            if not pending.done():  # nothing queued: waiting lets the loop run, a new slice starts after
                frames = await pending
                pace.restart()
            else:
                frames = pending.result()
            try:
                await self._receive(src, frames)
            except DecodeError as exc:
                src.decode_errors += 1
                log.warning("replica %s: %s", src.replica_id, exc)
            except Exception:  # one bad message must not end the stream
                src.decode_errors += 1
                log.exception("replica %s: failed to apply KV events", src.replica_id)
            before = pace.yields
            await pace.step()
            self.yields += pace.yields - before

    async def _receive(self, src: SourceState, frames: list[bytes]) -> None:
        _, seq, payload = decode_frames(frames)
        if not self.index.has_replica(src.replica_id):
            return  # replica deregistered; the owner will remove the source
        kind = self.classify(src, seq)
        if kind == "restart":
            kind = self.restart(src, seq)
        if kind == "duplicate":
            src.duplicates += 1
            return
        if kind == "gap":
            src.gaps += 1
            await self._recover(src, seq)
            if not self.index.has_replica(src.replica_id):
                return  # deregistered while the replay was applied
            self.index.mark_fresh(src.replica_id)
            if self.classify(src, seq) == "duplicate":  # the replay already delivered it
                return
        self.apply(src, seq, payload)

    async def _recover(self, src: SourceState, upto: int) -> None:
        """Close a gap [expected, upto) from the engine's replay buffer, or clear and rebuild.

        Exact when the buffer still holds every missed batch. Otherwise the replica's view is
        cleared (unless nothing was known yet: a late join) and rebuilt from whatever contiguous
        history the buffer still has, then from the live stream: an under-estimate of what the
        engine holds, never a phantom hit.
        """
        exp = self.expected(src)
        fetched = await self._fetch_replay(src, exp) if src.replay_endpoint is not None else {}
        pace = self._pace()
        if all(s in fetched for s in range(exp, upto)):
            while self.expected(src) in fetched:
                s = self.expected(src)
                self.apply(src, s, fetched[s])
                if not await self._paced(src, pace):
                    return
            src.replays_ok += 1
            return
        if src.replay_endpoint is not None:
            src.replays_failed += 1
        if src.last_seq is not None:
            self.resync_fresh(src)
        # only the unbroken run of batches ending just before `upto`: a batch before a hole (a reply cut
        # short, a batch the relay never got) may store a block a batch in the hole removed
        first = upto
        while first - 1 in fetched and first - 1 >= exp:
            first -= 1
        for s in range(first, upto):
            self.apply(src, s, fetched[s])
            if not await self._paced(src, pace):
                return
        if self.expected(src) < upto:
            src.last_seq = upto - 1

    async def _paced(self, src: SourceState, pace: _Pace) -> bool:
        """`pace.step()` amid a replay; False when the replica was deregistered meanwhile (stop applying).
        The source's own stream waits meanwhile (this runs in its task), so the batches stay in order."""
        before = pace.yields
        await pace.step()
        if pace.yields == before:
            return True
        self.yields += 1
        return self.index.has_replica(src.replica_id)

    async def _fetch_replay(self, src: SourceState, start: int) -> dict[int, bytes]:
        """Ask the engine's ROUTER replay socket for every buffered batch with seq >= start."""
        zmq = self._zmq
        sock = self._secure(self._ctx.socket(zmq.DEALER), src.auth)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # a whole reply (up to the relay's buffer), not the first 1000 batches
        fetched: dict[int, bytes] = {}
        try:
            sock.connect(src.replay_endpoint)
            try:  # a DEALER's send waits while it has no pipe (an endpoint refusing its handshake): bounded
                async with asyncio.timeout(self.replay_timeout_s):  # keeps a cancel that comes as the send ends
                    await sock.send_multipart([b"", start.to_bytes(8, "big")])
            except TimeoutError:
                return fetched  # nothing fetched: the caller treats the gap as unrecoverable
            while await sock.poll(int(self.replay_timeout_s * 1000)):
                msg = await sock.recv_multipart()
                if len(msg) != 4:
                    break
                _, _topic, seq_b, payload = msg
                seq = int.from_bytes(seq_b, "big")
                if seq == END_SEQ:
                    break
                if seq >= start:
                    fetched[seq] = payload
        finally:
            sock.close(linger=0)
        return fetched

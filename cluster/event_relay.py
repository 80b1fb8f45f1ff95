"""The engine side of KV-event ingestion: forward a replica's private vLLM stream to routers, minus prompts.

Why: vLLM's `BlockStored` carries the prompt's token ids (and the tenant's cache salt in `extra_keys`).
Routers need only block hashes, the parent hash, block size, medium, LoRA id, KV-cache group and
locality. So vLLM's publisher stays private to the replica (an ipc socket in a 0700 folder), and
`EventRelay`, running in the replica's process, re-publishes each batch stripped to those fields
(`routing_payload`), over CURVE (`cluster/secure_channel.py`) on the address routers reach.

The relay speaks vLLM's protocol on both of its sockets, so `cluster/kv_events.KVEventSubscriber` needs
no other mode: the PUB sends `[topic, seq, payload]` with vLLM's own sequence numbers, and the ROUTER
answers a replay request `[b"", start_seq]` with every buffered batch from `start_seq` and an end
marker. A batch the relay itself missed is fetched from vLLM's private replay socket; one it cannot
get is never sent, so the subscriber sees the gap and clears the replica's view (never a phantom hit).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import msgpack

from kvmesh.cluster.kv_events import _ARRAY_FIELDS, END_SEQ, DecodeError, decode_frames, unpack_batch
from kvmesh.cluster.secure_channel import ChannelKeys, ChannelServer
from kvmesh.cluster.thread_names import name_this_thread

log = logging.getLogger("ray.serve.kvmesh")

# What routing needs from each event; everything else (token_ids, extra_keys with the cache salt,
# lora_name) stays inside the replica.
ROUTING_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "block_size", "lora_id", "medium", "group_idx", "locality"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality"),
    "AllBlocksCleared": (),
}
_END = END_SEQ.to_bytes(8, "big")


def _routing_event(raw: Any) -> dict | None:
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):  # older array form
        raw = {"type": raw[0], **dict(zip(_ARRAY_FIELDS.get(raw[0], ()), raw[1:]))}
    if not isinstance(raw, dict):
        raise DecodeError(f"malformed KV event: {raw!r:.80}")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in ROUTING_FIELDS:
        return None  # an event type routers do not use: it stays here
    return {"type": kind, **{k: raw[k] for k in ROUTING_FIELDS[kind] if raw.get(k) is not None}}


def routing_payload(payload: bytes) -> bytes:
    """vLLM's msgpack `[ts, [events], dp_rank]` -> the same batch with only the routing fields."""
    ts, raw, dp_rank = unpack_batch(payload)
    return msgpack.packb([ts, [e for e in map(_routing_event, raw) if e is not None], dp_rank])


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


class EventRelay:
    """One engine's stream: SUB on vLLM's private endpoint, CURVE PUB + replay ROUTER for routers."""

    def __init__(
        self,
        upstream: str,
        upstream_replay: str | None,
        *,
        bind_host: str,
        keys: ChannelKeys,
        topic: str = "",
        buffer_steps: int = 10_000,
        replay_timeout_s: float = 1.0,
    ):
        import zmq

        self._server = ChannelServer(keys)
        ctx = self._server.ctx
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)  # vLLM binds its ipc endpoint; a connect before the bind just retries
        self._upstream_replay = upstream_replay
        self._pub = self._server.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._server.socket(zmq.ROUTER)
        # a ROUTER drops what is past a peer's high-water mark without a word (the end marker included):
        # room for a whole reply, the buffer and its end
        self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
        if ":" in bind_host:
            for s in (self._pub, self._replay):
                s.setsockopt(zmq.IPV6, 1)
        base = _tcp(bind_host)
        self.endpoint = f"{base}:{self._pub.bind_to_random_port(base)}"
        self.replay_endpoint = f"{base}:{self._replay.bind_to_random_port(base)}"
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.last_seq: int | None = None
        self.forwarded = self.filled = self.lost = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvmesh-event-relay")
        self._thread.start()

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        import zmq

        name_this_thread("kvmesh-relay")
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(100))
                if self._replay in ready:
                    self._serve_replay(self._replay.recv_multipart())
                if self._sub in ready:
                    self._on_upstream(self._sub.recv_multipart())
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("KV-event relay: socket error")
            except Exception:  # one bad message must not end the stream
                log.exception("KV-event relay: failed to forward a batch")

    def _on_upstream(self, frames: list[bytes]) -> None:
        try:
            _, seq, payload = decode_frames(frames)
        except DecodeError as exc:
            self.dropped += 1
            log.warning("KV-event relay: %s", exc)
            return
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq < expected:
            return  # a duplicate
        if seq > expected:
            self._fill(expected, seq)
        self._forward(seq, payload)

    def _fill(self, start: int, upto: int) -> None:
        """Fetch [start, upto) from vLLM's private replay buffer; what it lacks stays a gap for routers."""
        fetched = self._fetch_upstream(self._upstream_replay, start) if self._upstream_replay else {}
        for seq in sorted(s for s in fetched if start <= s < upto):
            self._forward(seq, fetched[seq])
            self.filled += 1
        self.lost += sum(1 for s in range(start, upto) if s not in fetched)

    def _fetch_upstream(self, endpoint: str, start: int) -> dict[int, bytes]:
        import zmq

        sock = self._server.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        fetched: dict[int, bytes] = {}
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(self._replay_timeout_ms):
                msg = sock.recv_multipart()
                if len(msg) != 4 or msg[2] == _END:
                    break
                fetched[int.from_bytes(msg[2], "big")] = msg[3]
        finally:
            sock.close(linger=0)
        return fetched

    def _forward(self, seq: int, payload: bytes) -> None:
        try:
            stripped = routing_payload(payload)
        except DecodeError as exc:  # not forwarded: routers see a gap and clear, never trust a guess
            self.dropped += 1
            log.warning("KV-event relay: seq %d: %s", seq, exc)
            return
        finally:
            self.last_seq = seq
        seq_b = seq.to_bytes(8, "big")
        self._pub.send_multipart([self._topic, seq_b, stripped])
        self._buffer.append((seq, stripped))
        self.forwarded += 1

    def _serve_replay(self, frames: list[bytes]) -> None:
        """vLLM's replay protocol: [client, b"", start_seq] -> every buffered batch >= start, then END."""
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", b"", _END, b""])

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> dict[str, int | None]:
        keys = ("forwarded", "filled", "lost", "dropped", "last_seq")
        return {k: getattr(self, k) for k in keys}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        for s in (self._sub, self._pub, self._replay):
            s.close(linger=0)
        self._server.close()

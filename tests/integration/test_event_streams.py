"""What crosses the network from an engine: live engines' KV-event streams are CURVE-only and carry no
token ids, and the relay in front of vLLM's own publisher keeps replay exact.

A subscriber or replay client without the deployment's channel key receives nothing; one with it gets
events that hold block hashes but no token ids, no cache salt and no LoRA name.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import msgpack
import pytest
import zmq

from kvmesh.cluster.event_relay import EventRelay
from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import KVEventSubscriber
from kvmesh.cluster.secure_channel import ChannelKeys, channel_keys, secure_client

pytestmark = pytest.mark.integration

FORBIDDEN = {"token_ids", "extra_keys", "lora_name"}
_rng = random.Random(4321)


def _routing_stats(client) -> dict:
    state = client.get("/kvmesh/state").json()["router"]
    if state is None:  # the router is created with the first engine request
        client.post("/v1/completions", json={"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 1})
        state = client.get("/kvmesh/state").json()["router"]
    return state["routing_stats"]


def _drain(sock, wait_ms: int) -> list[list[bytes]]:
    got = []
    while sock.poll(wait_ms):
        got.append(sock.recv_multipart())
        wait_ms = 0
    return got


def test_live_engine_streams_are_curve_only_and_carry_no_token_ids(live_app):
    keys = channel_keys()  # the secret start_local wrote for this run
    ctx = zmq.Context()
    # every socket closes at once, one dropped mid-test too: a DEALER the server's CURVE refused keeps its
    # unsent request, and with the default linger the context's end waited for it forever (a CI run hung here)
    ctx.setsockopt(zmq.LINGER, 0)
    try:
        with live_app.client() as c:
            stats = _routing_stats(c)
            assert len(stats) == 2
            plain_subs, key_subs = [], []
            for s in stats.values():
                assert s["events_auth"] == "curve"
                plain = ctx.socket(zmq.SUB)
                keyed = secure_client(ctx.socket(zmq.SUB), keys)
                for sock in (plain, keyed):
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                    sock.connect(s["kv_events_endpoint"])
                plain_subs.append(plain)
                key_subs.append(keyed)
            # the same prompt to both engines' streams until the key holder has seen its blocks stored
            prompt = [_rng.randrange(10, 1000) for _ in range(3 * 32 + 5)]
            frames: list[list[bytes]] = []
            deadline = time.monotonic() + 120
            while not any(b"BlockStored" in f[2] for f in frames) and time.monotonic() < deadline:
                prompt = prompt + [_rng.randrange(10, 1000)]
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                for sock in key_subs:
                    frames += _drain(sock, 300)
        stored = []
        for _topic, _seq, payload in frames:
            for ev in msgpack.unpackb(payload, raw=False)[1]:
                assert not FORBIDDEN & set(ev), ev
                if ev["type"] == "BlockStored":
                    stored.append(ev)
        assert stored and all(ev["block_hashes"] and ev["block_size"] == 32 for ev in stored)
        for sock in plain_subs:  # connected as long as the key holders, yet received nothing
            assert _drain(sock, 300) == []

        replayed = 0
        for s in stats.values():  # replay: nothing without the key, stripped history with it
            plain = ctx.socket(zmq.DEALER)
            keyed = secure_client(ctx.socket(zmq.DEALER), keys)
            for sock in (plain, keyed):
                sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused DEALER can lose its pipe and block sending
                sock.connect(s["replay_endpoint"])
            with contextlib.suppress(zmq.Again):  # refused before it could queue: it gets nothing either way
                plain.send_multipart([b"", (0).to_bytes(8, "big")])
            keyed.send_multipart([b"", (0).to_bytes(8, "big")])
            replies = []
            while keyed.poll(10_000):
                msg = keyed.recv_multipart()
                if msg[2] == b"\xff" * 8:
                    break
                replies.append(msg)
            replayed += len(replies)
            for _empty, _topic, _seq, payload in replies:
                assert all(not FORBIDDEN & set(ev) for ev in msgpack.unpackb(payload, raw=False)[1])
            assert not plain.poll(300)
        assert replayed  # the key holder got the history back (from the replica the requests went to)
    finally:
        ctx.destroy(linger=0)


def test_relay_in_front_of_vllms_publisher_fills_what_it_missed_from_vllms_replay(tmp_path):
    """The relay joins after vLLM published: it fetches the history from vLLM's private replay socket,
    and a router then gets all of it, token ids stripped, through the relay's own CURVE replay."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    keys = ChannelKeys.from_secret(b"integration-relay-secret-0123")
    raw, raw_replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = kv.ZmqEventPublisher(0, endpoint=raw, replay_endpoint=raw_replay, topic="kvmesh")

    def stored(hashes):
        return kv.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=[5] * 32,
            block_size=32,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )

    relay = None
    try:
        for h in (1, 2, 3):  # before the relay exists: only vLLM's buffer has these
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored([h])]))
        time.sleep(0.3)
        relay = EventRelay(raw, raw_replay, bind_host="127.0.0.1", keys=keys, topic="kvmesh")

        async def scenario():
            index = PrefixIndex()
            index.add_replica("e0")
            sub = KVEventSubscriber(index, keys=keys)
            try:
                await sub.add_source(
                    "e0", relay.endpoint, topic="kvmesh", replay_endpoint=relay.replay_endpoint, auth="curve"
                )
                h = 4
                while sub.sources["e0"].last_seq is None and h < 400:
                    pub.publish(kv.KVEventBatch(ts=time.time(), events=[stored([h])]))
                    h += 1
                    await asyncio.sleep(0.1)
                # seq 0..2 (and any the relay's SUB dropped while joining) came from vLLM's replay buffer
                assert relay.stats()["filled"] >= 3 and relay.stats()["lost"] == 0
                assert index.match([1, 2, 3, 4])["e0"][0] == 4
                assert sub.sources["e0"].replays_failed == 0
            finally:
                await sub.close()

        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        if relay is not None:
            relay.close()
        pub.shutdown()


def test_a_real_engine_replica_publishes_only_through_its_relay(tiny_model_dir, tmp_path, monkeypatch):
    """EngineReplica with a real vLLM engine (no Ray): vLLM's publisher is on ipc only, and the advertised
    endpoint hands the key holder BlockStored events without token ids, and a plain subscriber nothing."""
    from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV, write_channel_secret
    from kvmesh.deployments.engine import EngineReplica

    monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(write_channel_secret(tmp_path / "run")))
    replica = EngineReplica(
        {"model": "tiny", "num_gpu_blocks_override": 64, "max_model_len": 512, "engine_mode": "inproc"}
    )
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)  # as above: closing never waits for an unsent message
    try:
        stats = replica.record_routing_stats()
        assert stats["events_auth"] == "curve" and stats["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
        plain = ctx.socket(zmq.SUB)
        keyed = secure_client(ctx.socket(zmq.SUB), channel_keys())
        for sock in (plain, keyed):
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(stats["kv_events_endpoint"])
        prompt = [_rng.randrange(10, 1000) for _ in range(2 * 32 + 3)]

        async def run(tokens):
            request = {"request_id": f"r{len(tokens)}", "prompt_token_ids": tokens, "params": {"max_tokens": 1}}
            return [c async for c in replica.generate(request)]

        frames: list[list[bytes]] = []
        while not any(b"BlockStored" in f[2] for f in frames) and len(prompt) < 400:
            asyncio.run(run(prompt))
            frames += _drain(keyed, 500)
            prompt = prompt + [_rng.randrange(10, 1000) for _ in range(32)]
        stored = [ev for f in frames for ev in msgpack.unpackb(f[2], raw=False)[1] if ev["type"] == "BlockStored"]
        assert stored and all(not FORBIDDEN & set(ev) for ev in stored)
        assert _drain(plain, 300) == []
    finally:
        ctx.destroy(linger=0)
        replica.driver.shutdown()
        replica._release()

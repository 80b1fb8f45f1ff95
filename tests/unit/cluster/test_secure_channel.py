"""CURVE channels (cluster/secure_channel.py): a peer without the deployment's client key gets nothing."""

from __future__ import annotations

import contextlib
import stat
import time

import pytest
import zmq

from kvmesh.cluster.secure_channel import (
    CHANNEL_SECRET_FILE_ENV,
    ChannelError,
    ChannelKeys,
    ChannelServer,
    channel_keys,
    secure_client,
    write_channel_secret,
)


def test_keys_are_derived_from_the_secret_and_differ_per_secret_and_role():
    a, a2 = ChannelKeys.from_secret(b"s" * 32), ChannelKeys.from_secret(b"s" * 32)
    b = ChannelKeys.from_secret(b"t" * 32)
    assert a == a2
    assert a.server_public != b.server_public and a.client_public != b.client_public
    assert a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert repr(a.server_secret) not in repr(a) and repr(a.client_secret) not in repr(a)


def test_secret_file_is_owner_only_and_loads_from_the_environment(tmp_path, monkeypatch):
    path = write_channel_secret(tmp_path / "run")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.setenv(CHANNEL_SECRET_FILE_ENV, str(path))
    assert channel_keys() == ChannelKeys.from_secret(path.read_bytes().strip())


def test_missing_or_short_secret_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(CHANNEL_SECRET_FILE_ENV, raising=False)
    with pytest.raises(ChannelError, match=CHANNEL_SECRET_FILE_ENV):
        channel_keys()
    with pytest.raises(ChannelError, match="cannot read"):
        channel_keys(tmp_path / "absent")
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ChannelError, match="too short"):
        channel_keys(tmp_path / "short")


def _recv_all(sock, wait_ms: int) -> list:
    got = []
    while sock.poll(wait_ms):
        got.append(sock.recv_multipart())
        wait_ms = 0
    return got


def test_only_the_client_key_receives_from_a_curve_publisher():
    keys = ChannelKeys.from_secret(b"deployment-secret-0123456789")
    other = ChannelKeys.from_secret(b"someone-elses-secret-0123456789")
    server = ChannelServer(keys)
    ctx = zmq.Context()
    try:
        pub = server.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        plain = ctx.socket(zmq.SUB)
        # knows the server's public key (public keys are not secret) but holds another client key
        impostor = secure_client(ctx.socket(zmq.SUB), other)
        impostor.curve_serverkey = keys.server_public
        good = secure_client(ctx.socket(zmq.SUB), keys)
        for s in (plain, impostor, good):
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{port}")
        received = []
        for i in range(600):  # until the key holder has 20 messages (fails after ~30 s)
            pub.send_multipart([b"kvmesh", i.to_bytes(8, "big"), b"payload"])
            received += _recv_all(good, 50)
            if len(received) >= 20:
                break
        assert len(received) >= 20
        assert received[0][0] == b"kvmesh"
        assert _recv_all(plain, 300) == [] and _recv_all(impostor, 300) == []
    finally:
        ctx.destroy(linger=0)
        server.close()


def test_a_curve_router_answers_only_the_client_key():
    keys = ChannelKeys.from_secret(b"deployment-secret-0123456789")
    server = ChannelServer(keys)
    ctx = zmq.Context()
    try:
        router = server.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        plain = ctx.socket(zmq.DEALER)
        good = secure_client(ctx.socket(zmq.DEALER), keys)
        for s in (plain, good):
            # a DEALER blocks sending while it has no pipe, which the plain one loses each time the server
            # refuses its handshake: bounded, so a refused send cannot hang the test
            s.setsockopt(zmq.SNDTIMEO, 2000)
            s.connect(f"tcp://127.0.0.1:{port}")
        with contextlib.suppress(zmq.Again):  # refused before it could queue: it never arrives either way
            plain.send_multipart([b"", b"hello"])
        good.send_multipart([b"", b"hello"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not router.poll(100):
            pass
        requests = _recv_all(router, 300)
        assert [r[1:] for r in requests] == [[b"", b"hello"]]  # the plain DEALER's request never arrived
        router.send_multipart([requests[0][0], b"", b"answer"])
        assert good.poll(5000) and good.recv_multipart() == [b"", b"answer"]
        assert not plain.poll(200)
    finally:
        ctx.destroy(linger=0)
        server.close()

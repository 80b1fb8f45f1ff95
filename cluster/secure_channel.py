"""ZMQ CURVE for every stream kvmesh sends between nodes: encrypted, and only for holders of the secret.

Why: what crosses the pod network (the engines' KV-event streams and their replay endpoints, and any
router-to-router sync) describes tenants' cached prefixes. Without CURVE any pod could subscribe. With
it, a peer must prove it holds the deployment's client key before libzmq hands it a single message;
a subscriber without the key is refused by the ZAP handler and receives nothing.

Keys come from one deployment secret, a file like the salt secret (a mounted Kubernetes secret; locally
a 0600 file under KVMESH_HOME, written by `write_channel_secret`), named by $KVMESH_CHANNEL_SECRET_FILE.
Two Curve25519 keypairs are derived from it with HMAC-SHA256 (one for servers, one for clients), so
every process holding the file can serve and connect, and nothing but the file needs distributing.

    keys = channel_keys()                       # from $KVMESH_CHANNEL_SECRET_FILE
    server = ChannelServer(keys)                # its context admits only the client key
    pub = server.socket(zmq.PUB)                # bind it where peers can reach it
    sub = ctx.socket(zmq.SUB); secure_client(sub, keys); sub.connect(endpoint)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHANNEL_SECRET_FILE_ENV = "KVMESH_CHANNEL_SECRET_FILE"
MIN_SECRET_BYTES = 16
# How the example secrets (k8s/secrets.example.yaml) start: a deployment running on one shares its keys with
# everyone who has read the example.
PLACEHOLDER_PREFIX = b"REPLACE-"  # the salt secret's too (deployments/salt_secret.py)
ZAP_DOMAIN = "kvmesh"
_KEY_DOMAIN = b"kvmesh-channel-key\0"


class ChannelError(RuntimeError):
    """No usable channel secret (missing, unreadable, too short or the example's placeholder), or no CURVE in
    libzmq."""


def _keypair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 Curve25519 keys for `role`; any 32 bytes are a valid Curve25519 secret."""
    import zmq
    from zmq.utils import z85

    secret_key = z85.encode(hmac.new(secret, _KEY_DOMAIN + role, hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


@dataclass(frozen=True)
class ChannelKeys:
    """The deployment's two CURVE keypairs (z85): servers bind with one, clients connect with the other."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> ChannelKeys:
        if secret.startswith(PLACEHOLDER_PREFIX):
            raise ChannelError(
                "channel secret is the example's placeholder (REPLACE-...): create it from random bytes, "
                "e.g. `openssl rand -hex 32` (docs/kubernetes.md)"
            )
        if len(secret) < MIN_SECRET_BYTES:
            raise ChannelError(f"channel secret is too short: need at least {MIN_SECRET_BYTES} bytes")
        return cls(*_keypair(secret, b"server"), *_keypair(secret, b"client"))

    def __repr__(self) -> str:  # never print secret keys
        return f"ChannelKeys(server_public={self.server_public!r})"


def channel_keys(path: str | os.PathLike | None = None) -> ChannelKeys:
    """The keys from `path`, else from $KVMESH_CHANNEL_SECRET_FILE; ChannelError when neither is usable."""
    import zmq

    if not zmq.has("curve"):
        raise ChannelError("this libzmq has no CURVE support: kvmesh's cross-node streams need it")
    path = path or os.environ.get(CHANNEL_SECRET_FILE_ENV)
    if not path:
        raise ChannelError(f"no channel secret: set {CHANNEL_SECRET_FILE_ENV} to the deployment's secret file")
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ChannelError(f"cannot read channel secret file {path}: {exc.strerror}") from None
    return ChannelKeys.from_secret(secret)


def write_secret_file(directory: str | os.PathLike, prefix: str, data: bytes) -> Path:
    """`data` in a new owner-only (0600) file `prefix-<this pid>-<owner tag>-XXXXXXXX` under `directory` (made
    0700), never over an existing one; returns its path. The pid and the tag (`private_dir.owner_tag`: which
    pid namespace, boot and host the pid is of) name the file's owner for `remove_dead_owners_secret_files`."""
    from kvmesh.kvstore import private_dir

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{prefix}-{os.getpid()}-{private_dir.owner_tag()}-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


_OWNED_SECRET_FILE = re.compile(r"[a-z][a-z-]*-(\d+)-([0-9a-f]{8})-[0-9a-f]{8}")


def remove_dead_owners_secret_files(directory: str | os.PathLike) -> int:
    """Remove this user's secret files (`write_secret_file`'s `<prefix>-<owner pid>-<owner tag>-*`) under
    `directory` whose owner process is gone: one killed outright (SIGKILL, a second Ctrl-C) never removes its
    own, and each left behind is a secret for whoever reads the folder later. Only files with this process's
    owner tag are judged: the folder may be shared with a container or, on an NFS home, another host, whose
    pids mean nothing here (a live run there would lose its secret). Returns how many were removed."""
    from kvmesh.kvstore import private_dir

    removed = 0
    try:
        entries = list(os.scandir(os.fspath(directory)))
    except FileNotFoundError:
        return 0
    for entry in entries:
        m = _OWNED_SECRET_FILE.fullmatch(entry.name)
        if not m or m.group(2) != private_dir.owner_tag() or not entry.is_file(follow_symlinks=False):
            continue  # not a secret file, or one of another pid namespace, boot or host
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue  # not ours to judge
        except OSError:  # gone meanwhile
            continue
        if private_dir.owner_gone(int(m.group(1))):
            try:
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def write_channel_secret(directory: str | os.PathLike) -> Path:
    """A new random channel secret in an owner-only (0600) file under `directory`; returns its path."""
    return write_secret_file(directory, "channel-secret", secrets.token_hex(32).encode())


class _OnlyKey:
    """ZAP credentials check: admit exactly one client public key."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


class ChannelServer:
    """A zmq context for the serving side of CURVE channels, with a ZAP handler that admits only
    the deployment's client key (without a ZAP handler libzmq would let any CURVE client in)."""

    def __init__(self, keys: ChannelKeys):
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        self.keys = keys
        self.ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, _OnlyKey(keys.client_public))

    def socket(self, kind: int) -> Any:
        """A CURVE server socket of `kind` (zmq.PUB, zmq.ROUTER, ...) in this context, not yet bound."""
        sock = self.ctx.socket(kind)
        sock.curve_server = True
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.zap_domain = ZAP_DOMAIN.encode()
        return sock

    def close(self) -> None:
        self._auth.stop()
        self.ctx.destroy(linger=0)


def secure_client(sock: Any, keys: ChannelKeys) -> Any:
    """Make `sock` (sync or asyncio, before connect) a CURVE client of the deployment's servers."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    return sock

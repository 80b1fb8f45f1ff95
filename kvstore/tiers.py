"""Tier configuration: host-memory L1 and shared L2 of the node's LMCache server, and the vLLM side.

Pure configuration: it starts nothing, reads no files and imports no other kvstore module (the server
process is `lmcache_server`, the Ray actor that owns it and the engines' start-up call are `node_server`),
so every side reads it without an import circle. The one outside value it uses is kvmesh's home folder
(`$KVMESH_HOME`, else ~/.cache/kvmesh) for the default fs L2.

One `TierConfig` describes what every node runs: how much host DRAM the LMCache MP server keeps (L1)
and which shared store it writes through to (L2). The same config yields the server's command line
(`server_args`) and the engine's `kv_transfer_config` (`kv_transfer_config`), so both sides agree on
chunk size and transfer mode — the two settings that otherwise hang or silently miss on CPU
(docs/tiers.md, "CPU traps").

L2 spellings accepted (`l2` key):
- None / "none": host tier only.
- "fs" (+ `l2_path`, default `$KVMESH_HOME/lmcache-l2`) or {"type": "fs", "base_path": DIR}: a local folder
  only kvmesh's user may enter (the server refuses one open to others); the embedded default.
- "redis://HOST:PORT" or {"type": "resp", "host": H, "port": P}: Redis via LMCache's `resp` adapter;
  "redis://[USER]:PASSWORD@HOST:PORT" or "password"/"username" keys for a Redis that requires AUTH
  (they reach the server process as LMCACHE_RESP_PASSWORD/USERNAME, never on its command line).
- "valkey://HOST:PORT" or {"type": "valkey", "startup_nodes": "H:P"}: LMCache's `valkey` adapter;
  "valkey://[USER]:PASSWORD@HOST:PORT" keeps its credentials as the adapter's "username"/"password" keys
  (that adapter reads no environment variables; its JSON travels in the environment, below).
- any other {"type": NAME, ...}: passed to LMCache unchanged (mooncake_store, s3, p2p, ...).
Every adapter but `resp` reaches the server as JSON in its environment (`L2_ADAPTER_ENV`), never on its
command line: their credential keys differ per adapter (password, aws_secret_access_key, ...).

The server listens on no TCP port: engines reach it through an ipc socket in a 0700 folder of its owner
(`request_host`), and its metrics through a unix socket beside it (`metrics_socket_path`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

CONNECTOR = "LMCacheMPConnector"
# The connector's liveness settings (LMCache's defaults: 10 s heartbeat, 300 s message-queue timeout).
# A connector only re-registers its KV caches with a restarted server after one of its heartbeat PINGs
# went unanswered, and the new server answers PING for workers it has never seen, so a restart that
# the heartbeat misses leaves the engine talking to a server that does not know it: every store or
# retrieve then waits out the full message-queue timeout (an engine stalled for minutes). A short
# heartbeat makes a restart visible quickly (LMCacheServer keeps the port dark long enough, see
# RESTART_DARK_S there), and a short timeout bounds the stall of a request caught mid-restart: it
# fails over to recompute instead of hanging.
HEARTBEAT_S = 2.0
MQ_TIMEOUT_S = 20.0
_EVICTION_POLICIES = ("LRU", "ARC", "IsolatedLRU", "noop")
_KNOWN_KEYS = {
    "l1_size_gb",
    "chunk_size",
    "eviction_policy",
    "l2",
    "l2_path",
    "max_workers",
    "extra_args",
    "start_timeout_s",
    "watch_interval_s",
}
# Settings of the TCP ports the server once listened on: refused, not ignored, so that a config meant to open
# the server to other hosts says why it cannot.
_RETIRED_KEYS = {"host", "port", "prometheus_port"}
# LMCache's connector joins `lmcache.mp.host` and `lmcache.mp.port` with ':' into its ZMQ endpoint. Over ipc
# the "port" is only the tail of the socket's file name: one fixed number.
SOCKET_PORT = 1
# The environment variable that carries a non-resp L2 adapter's JSON to the server (kvstore/lmcache_main.py).
L2_ADAPTER_ENV = "KVMESH_LMCACHE_L2_ADAPTER"


class TierConfigError(ValueError):
    """A tier setting is wrong; the message names the key and what is allowed."""


@dataclass
class TierConfig:
    l1_size_gb: float = 1.0
    chunk_size: int = 256  # tokens per LMCache chunk; must be a multiple of the engine's block size
    eviction_policy: str = "LRU"
    l2: dict | None = None  # normalised LMCache `--l2-adapter` JSON object, or None
    max_workers: int = 1
    extra_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 180.0
    watch_interval_s: float = 2.0  # node server's watchdog period (0 = no watchdog)

    @classmethod
    def from_dict(cls, d: dict | None) -> TierConfig:
        """Build from the engine config's `lmcache` dict; unknown keys are errors, not ignored."""
        d = dict(d or {})
        retired = sorted(set(d) & _RETIRED_KEYS)
        if retired:
            raise TierConfigError(
                f"lmcache key(s) {retired} are no longer settings: the node's LMCache server listens only on a "
                "unix socket in a private folder, reachable by its own node's engines (docs/security.md)"
            )
        unknown = sorted(set(d) - _KNOWN_KEYS)
        if unknown:
            raise TierConfigError(f"unknown lmcache key(s) {unknown}; allowed: {sorted(_KNOWN_KEYS)}")
        l2 = normalise_l2(d.pop("l2", None), d.pop("l2_path", None))
        cfg = cls(l2=l2, **d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """TierConfigError naming the first setting of the wrong type or out of range. Why here: the engine
        config's check (deployments/config.py) is this one, and a value that passed it would otherwise reach
        LMCache's command line wrongly (a string of extra_args split into characters) or fail on every node."""
        if not _finite(self.l1_size_gb) or self.l1_size_gb <= 0:
            raise TierConfigError(f"l1_size_gb must be a positive number (GB), got {self.l1_size_gb!r}")
        if not _whole(self.chunk_size) or self.chunk_size <= 0:
            raise TierConfigError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        if self.eviction_policy not in _EVICTION_POLICIES:
            raise TierConfigError(f"eviction_policy must be one of {_EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if not _whole(self.max_workers) or self.max_workers < 1:
            raise TierConfigError(f"max_workers must be a positive integer, got {self.max_workers!r}")
        if not isinstance(self.extra_args, (list, tuple)) or not all(isinstance(a, str) for a in self.extra_args):
            # the value itself is not echoed: a server argument may carry a credential
            raise TierConfigError(
                "extra_args must be a list of strings, one per argument (e.g. ['--eviction-ratio', '0.2']), "
                f"got {type(self.extra_args).__name__}"
                + ("" if not isinstance(self.extra_args, (list, tuple)) else " with items that are not strings")
            )
        if not _finite(self.start_timeout_s) or self.start_timeout_s <= 0:
            raise TierConfigError(f"start_timeout_s must be a positive number of seconds, got {self.start_timeout_s!r}")
        if not _finite(self.watch_interval_s) or self.watch_interval_s < 0:
            raise TierConfigError(
                f"watch_interval_s must be a number of seconds, 0 for no watchdog, got {self.watch_interval_s!r}"
            )

    def check_block_size(self, block_size: int) -> None:
        """LMCache stores whole chunks of whole engine blocks; a mismatch means no hits at all."""
        if self.chunk_size % block_size:
            raise TierConfigError(
                f"lmcache chunk_size {self.chunk_size} must be a multiple of the engine block_size {block_size}"
            )

    @property
    def shared_tier(self) -> str | None:
        """The L2 adapter type ('resp', 'fs', ...) or None when there is no shared tier."""
        return self.l2["type"] if self.l2 else None


def _finite(value) -> bool:
    """A finite int or float (a bool is not a number here: `true` in YAML is no size)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


# the names of L2 settings that may name or hold a secret (adapters spell credentials their own way)
CREDENTIAL_KEY = re.compile(r"pass|secret|token|cred|auth|user|key", re.IGNORECASE)


def url_credentials(url: str) -> bool:
    """Does an L2 URL carry user info (anything before its last '@' after '://', as `redacted` reads it)?"""
    return "@" in url.partition("://")[2 if "://" in url else 0]


def redacted(l2) -> object:
    """An L2 setting fit for an error message or a log: its credentials replaced by '***'.

    A string loses everything between '://' and its last '@' as written, not as `urlparse` splits it: a
    password holding '/', '?' or '#' ends `urlparse`'s netloc early, and its parts then read as no password
    at all. A dict loses the values of keys that may name or hold a secret."""
    if isinstance(l2, str):
        scheme, sep, rest = l2.partition("://")
        if not sep:
            scheme, rest = "", l2
        if not url_credentials(l2):
            return l2
        return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"
    if isinstance(l2, dict):
        return {k: ("***" if CREDENTIAL_KEY.search(str(k)) else v) for k, v in l2.items()}
    return l2


def kvmesh_home() -> Path:
    """kvmesh's own folder for what can be made again ($KVMESH_HOME, else ~/.cache/kvmesh): the embedded
    model, a default fs shared tier. deployments/salt_secret.py's `kvmesh_home` (the salt secret, per-run
    secret files) defaults to ~/.kvmesh instead: secrets do not belong in a cache folder, and moving the kept
    salt secret would change every tenant's salt. With KVMESH_HOME set, both are that folder."""
    return Path(os.environ.get("KVMESH_HOME") or Path.home() / ".cache" / "kvmesh")


def default_fs_l2_path() -> str:
    """Where `l2: fs` without `l2_path` keeps its chunks: under kvmesh's home, not a fixed name in the shared
    temp folder, which another user could create first (and read what LMCache writes into it)."""
    return str(kvmesh_home() / "lmcache-l2")


def _parse_l2_url(l2: str):
    """urlparse and its port, without the ValueErrors either raises: their messages quote the URL's parts (a
    password holding '/' leaves its tail where the port goes), and callers echo what they catch."""
    try:
        url = urlparse(l2)
    except ValueError:
        raise TierConfigError(f"l2 {redacted(l2)!r} is not a URL kvmesh can read") from None
    try:
        port = url.port
    except ValueError:
        port = None
    return url, port


def normalise_l2(l2, l2_path: str | None = None) -> dict | None:
    """Turn the accepted spellings of an L2 into the JSON object LMCache's `--l2-adapter` takes."""
    if l2 is None or l2 == "none":
        return None
    if isinstance(l2, str):
        if l2 == "fs":
            return {"type": "fs", "base_path": l2_path or default_fs_l2_path()}
        url, port = _parse_l2_url(l2)
        if url.scheme in ("redis", "resp", "valkey"):
            if not url.hostname or not port:
                raise TierConfigError(
                    f"l2 URL {redacted(l2)!r} needs a host and a port, e.g. redis://127.0.0.1:6379 "
                    "(percent-encode '/', '?' and '#' in a password)"
                )
            if url.scheme == "valkey":
                out = {"type": "valkey", "startup_nodes": f"{url.hostname}:{port}"}
            else:
                out = {"type": "resp", "host": url.hostname, "port": port}
            if url.password:
                out["password"] = unquote(url.password)
            if url.username:
                out["username"] = unquote(url.username)
            return out
        raise TierConfigError(
            f"l2 {redacted(l2)!r} not understood; use none, fs, redis://H:P, valkey://H:P or an adapter dict"
        )
    if isinstance(l2, dict):
        if not isinstance(l2.get("type"), str):
            raise TierConfigError("an l2 adapter dict needs a string 'type' (fs, resp, valkey, mooncake_store, ...)")
        out = dict(l2)
        if out["type"] == "fs" and "base_path" not in out:
            raise TierConfigError("l2 type 'fs' needs 'base_path'")
        if out["type"] == "resp" and not (out.get("host") and out.get("port")):
            raise TierConfigError("l2 type 'resp' needs 'host' and 'port'")
        return out
    raise TierConfigError(f"l2 must be a string or a dict, got {type(l2).__name__}")


# resp's credential keys and the variables LMCache reads them from when its JSON names none
CREDENTIAL_ENV = {"password": "LMCACHE_RESP_PASSWORD", "username": "LMCACHE_RESP_USERNAME"}
# How the published example secrets' values start (k8s/secrets.example.yaml): a shared-tier password starting
# so is refused at the server's launch, as the salt and channel secrets are (cluster/secure_channel.py).
PASSWORD_PLACEHOLDER_PREFIX = "REPLACE-"


def _adapter_on_command_line(l2: dict) -> bool:
    """Only resp's JSON goes on the command line: LMCache reads its credentials from variables of its own."""
    return l2.get("type") == "resp"


def l2_credentials_env(l2: dict | None) -> dict[str, str]:
    """The environment that carries what of the L2 may be secret to the server process.

    Why: the server's command line is what `ps` shows every local user; its environment only its own user
    (and root) can read. resp: its credentials as the variables LMCache reads when its JSON names none.
    Any other adapter: its whole JSON (credential keys differ per adapter), which kvstore/lmcache_main.py
    hands to LMCache as `--l2-adapter` inside the server process.
    """
    if not l2:
        return {}
    if not _adapter_on_command_line(l2):
        return {L2_ADAPTER_ENV: json.dumps(l2, sort_keys=True)}
    return {env: str(l2[key]) for key, env in CREDENTIAL_ENV.items() if l2.get(key)}


def request_host(channel_dir: str | os.PathLike) -> str:
    """The `lmcache.mp.host` of a server whose sockets are in `channel_dir` (an ipc:// endpoint)."""
    return f"ipc://{os.fspath(channel_dir)}/requests"


def ipc_socket_path(host: str, port: int) -> str | None:
    """The file of the ipc socket LMCache's connector opens for host and port (None for a tcp:// host)."""
    if not host.startswith("ipc://"):
        return None
    return f"{host.removeprefix('ipc://')}:{port}"


def metrics_socket_path(host: str) -> str:
    """The unix socket, beside the request socket, on which the server serves its Prometheus metrics."""
    if not host.startswith("ipc://"):
        raise TierConfigError(f"the LMCache server's host must be an ipc:// endpoint, got {host!r}")
    return os.path.join(os.path.dirname(host.removeprefix("ipc://")), "metrics")


def server_args(cfg: TierConfig, host: str, port: int = SOCKET_PORT) -> list[str]:
    """Arguments for kvmesh's LMCache server (`kvstore/lmcache_main.py`, without the interpreter); `host` is the
    server's ipc:// endpoint (`request_host`)."""
    args = [
        "--host",
        host,
        "--port",
        str(port),
        "--l1-size-gb",
        repr(float(cfg.l1_size_gb)),
        "--no-l1-use-lazy",
        "--eviction-policy",
        cfg.eviction_policy,
        "--chunk-size",
        str(cfg.chunk_size),
        # CPU clients hang for 300 s without this (they cannot use the default lmcache_driven mode)
        "--supported-transfer-mode",
        "auto",
        "--max-workers",
        str(cfg.max_workers),
    ]
    if cfg.l2 and _adapter_on_command_line(cfg.l2):
        public = {k: v for k, v in cfg.l2.items() if k not in CREDENTIAL_ENV}
        args += ["--l2-adapter", json.dumps(public, sort_keys=True)]
    return args + list(cfg.extra_args)


def kv_transfer_config(host: str, port: int) -> dict:
    """The vLLM `kv_transfer_config` that connects an engine to the LMCache MP server at host:port.

    `host` is an endpoint with its scheme (kvmesh's servers: `ipc://DIR/requests`) or a bare TCP host."""
    if not host or not isinstance(port, int) or not 0 < port < 65536:
        raise TierConfigError(f"bad LMCache server endpoint {host!r}:{port!r}")
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": host if "://" in host else f"tcp://{host}",
            "lmcache.mp.port": port,
            "lmcache.mp.heartbeat_interval": HEARTBEAT_S,
            "lmcache.mp.mq_timeout": MQ_TIMEOUT_S,
        },
    }


def tier_routing_info(lmcache: dict | TierConfig, block_size: int, bytes_per_block: int | None = None) -> dict:
    """What an engine replica adds to `record_routing_stats()` so routers can model its node's tiers.

    {"chunk_blocks": LMCache chunk / engine block, "shared": has an L2,
     "host_capacity_blocks": L1 size / bytes per KV block (None when the block size in bytes is unknown)}
    Routers feed it to `kvmesh.cluster.tier_tracker.TierTracker.set_node`. An engine passes the config of
    the node server it connected to (`node_server.connect_node_server`), which may not be its own.
    """
    cfg = lmcache if isinstance(lmcache, TierConfig) else TierConfig.from_dict(lmcache)
    cfg.check_block_size(block_size)
    cap = int(cfg.l1_size_gb * (1 << 30) // bytes_per_block) if bytes_per_block else None
    return {"chunk_blocks": cfg.chunk_size // block_size, "shared": cfg.l2 is not None, "host_capacity_blocks": cap}


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1}


def kv_bytes_per_block(model_config: dict | None, block_size: int, dtype: str = "auto") -> int | None:
    """Bytes of one KV block (K and V, all layers) for a model's HF `config.json` contents; None when it
    cannot tell (no config, or fields missing).

    = 2 x layers x kv_heads x head_dim x block_size x bytes per element — what sizes L1 in blocks. The
    caller reads the file (`kvmesh.deployments.config.hf_model_config`): this module reads no files.
    """
    if model_config is None:
        return None
    c = model_config
    try:
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kv_heads = c.get("num_key_value_heads") or heads
        # vLLM's "auto" runs float32 checkpoints in 16-bit (bfloat16 on CPU), keeps 16-bit ones as they are
        per_elem = 2 if dtype == "auto" else _DTYPE_BYTES[str(dtype)]
        return 2 * c["num_hidden_layers"] * kv_heads * head_dim * block_size * per_elem
    except (KeyError, ValueError, TypeError):
        return None

"""Tenants: API keys -> tenant -> server-derived cache salt. The ingress's only source of identity.

Why: prefix caches are shared by every request an engine serves, so a tenant's cached blocks must be
keyed by something the client cannot choose. The salt is HMAC-SHA256(server secret, tenant or sharing
group) computed here, passed to vLLM as `cache_salt` (folded into the first block's hash, so into every
block hash, router key and LMCache key downstream). Keys are stored only as SHA-256 digests.

API for the ingress (deployments/ingress.py):

    from kvmesh.deployments.tenants import (TenantRegistry, AuthError, ClientSaltError, reject_client_salt,
                                     openai_error)
    from kvmesh.deployments.admission import Admission, AdmissionError, RateLimited
    from kvmesh.deployments.tenant_metrics import TenantMetrics

    registry = TenantRegistry.from_file(path)            # YAML/TOML/JSON; secret from env/file/generated;
                                                         #   follows the files' changes (`refresh`)
    registry = TenantRegistry.single_key(api_key)        # `kvmesh serve --api-key KEY`: one tenant "default"
    tenant = registry.authenticate(request.headers.get("authorization"))   # raises AuthError (401)
    reject_client_salt(body, request.headers)            # raises ClientSaltError (400) on cache_salt etc.
    admission = Admission.from_registry(registry)
    ticket = await admission.acquire(tenant, prompt_tokens)  # raises AdmissionError: RateLimited (429,
    try:                                                 #   .retry_after_s -> `Retry-After` header) or
        ... engine call with cache_salt=tenant.salt ...  #   PromptTooLarge (400)
    finally:
        admission.release(ticket)
    metrics = TenantMetrics()
    metrics.record(tenant.id, prompt_tokens, cached_tokens, ttft_s)
    metrics.record_rejection(tenant.id, exc.code)        # for AuthError use tenant id "unauthenticated"
    text = metrics.prometheus_text()                     # append to GET /metrics

Every error class here and in `admission` has `.status`, `.code`, `.message`, `.headers()` and
`.body()` (an OpenAI-style `{"error": {...}}` dict); `openai_error(status, message, code)` builds the
same body for the ingress's own errors. Messages never contain key material.

Config (see deployments/tenants.example.yaml and docs/tenants.md):

    secret_file: /etc/kvmesh/salt-secret     # optional; env KVMESH_SALT_SECRET / _FILE take precedence
    defaults: {limits: {requests_per_s: 20, tokens_per_min: 200000, max_prompt_tokens: 4096,
                        max_concurrent: 8}}
    admission: {max_concurrent: 64, queue_timeout_s: 10}
    tenants:
      - id: acme
        group: public-docs                   # optional: tenants naming one group share one salt
        keys: [{sha256: <hex of the key>}, {sha256: <hex>, revoked: true}]
        limits: {requests_per_s: 5}          # overrides defaults field by field

`python -m kvmesh.deployments.tenants new-key` prints a fresh key and its digest; `hash-key` hashes stdin.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvmesh.cluster.trace import brief
from kvmesh.deployments.config import ConfigError  # one class: a bad tenants config is a bad serving config
from kvmesh.deployments.tenant_metrics import UNAUTHENTICATED
from kvmesh.policies.cost_model import finite_number

log = logging.getLogger(__name__)

SECRET_ENV = "KVMESH_SALT_SECRET"
SECRET_FILE_ENV = "KVMESH_SALT_SECRET_FILE"
MIN_SECRET_BYTES = 16
KEY_PREFIX = "kvm-"
# Matched whole (`fullmatch`): a `$` anchor also matches before a trailing newline ("acme\n").
_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A bearer token: visible ASCII, no spaces, bounded length (RFC 6750 b64token plus a little slack).
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{8,256}")
# Tenant ids the ingress gives requests no configured tenant sent, in its metrics and admission: a
# configured tenant of that name would share their rows (every 401 counts under "unauthenticated";
# an ingress with no keys serves every request as "anonymous").
RESERVED_TENANT_IDS = frozenset({UNAUTHENTICATED, "anonymous"})
# Versioned domain separation: a group named like a tenant must not get that tenant's salt.
_SALT_DOMAIN = b"kvmesh-cache-salt-v1"
# SHA-256 digests of the API keys kvmesh's examples publish (k8s/tenants-secret.example.yaml and
# deployments/tenants.example.yaml, kvm-example-*): anyone who has read them can present these keys.
PUBLISHED_KEY_DIGESTS = frozenset(
    {
        "6658ae1b231e6321a4d67218210f1ba37cb3535b7185d0b538370043aa7ccf5d",
        "0b397c928f8a189f4b32877dd55a69df470cd29e2450b34cb28d1332d30a8d3b",
        "e0a9dab3bb6adee77a53fcdbb4afb1b1fd166612d894afe223d044af7250c9a1",
        "64783d661d7853c834917c87ec9af62b985d99ae11a76b69d29bcbb473ef5f0b",
        "f4091b84bf8c41aa7371b5b88e2c2f18a7c86ccc4706a6455d59f3f5fc12a81f",
    }
)
# The one file allowed to hold them: the local example itself (`kvmesh serve --tenants` it to try tenants on
# this machine). A copy of it, or of the Kubernetes example Secret, is a deployment's own file.
SHIPPED_EXAMPLE = Path(__file__).with_name("tenants.example.yaml")
# How often a registry loaded from a file looks at the file (and the salt secret file) again: at most once per
# this many seconds, on the request path (`TenantRegistry.refresh`).
RELOAD_INTERVAL_S = 5.0


def openai_error(status: int, message: str, code: str, err_type: str | None = None, param: str | None = None) -> dict:
    """The OpenAI error body shape, so the official client raises its usual exception types."""
    if err_type is None:
        err_type = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class KvmeshHTTPError(Exception):
    """An error the ingress turns into an HTTP response as is."""

    status = 400

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message = message
        self.code = code

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict:
        return openai_error(self.status, self.message, self.code)


class AuthError(KvmeshHTTPError):
    """401: missing, malformed, unknown or revoked API key. Never carries the key itself."""

    status = 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="kvmesh"'}


class ClientSaltError(KvmeshHTTPError):
    """400: the client tried to choose its cache salt or tenant; only the server may."""

    status = 400


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-tenant limits; None = unlimited."""

    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_prompt_tokens: int | None = None
    max_concurrent: int | None = None
    # Token-bucket burst for requests_per_s (default: max(1, requests_per_s)); needs requests_per_s.
    burst_requests: float | None = None
    # The most urgent vLLM `priority` the tenant's requests may ask (lower is served first where the engines
    # schedule by priority, `engine.scheduling_policy: priority`), and theirs when they ask none; None: any.
    min_priority: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, base: Limits | None = None, where: str = "limits") -> Limits:
        base = base or cls()
        if raw is None:
            return base
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:  # a typo must not silently lift a limit
            raise ConfigError(f"{where}: unknown key(s) {_sorted_keys(unknown)}; allowed: {sorted(names)}")
        values: dict[str, Any] = {}  # field -> float, int (the count fields) or None
        for name, value in raw.items():
            if value is None:
                values[name] = None
            elif name in _COUNT_LIMITS:
                values[name] = _count(value, f"{where}.{name}")
            elif name == "min_priority":
                values[name] = _integer(value, f"{where}.{name}")
            elif name in ("burst_requests", "tokens_per_min"):
                values[name] = _at_least(value, f"{where}.{name}", 1)
            elif name == "requests_per_s":
                values[name] = _at_least(value, f"{where}.{name}", MIN_REQUESTS_PER_S, " (one request in 11.6 days)")
            else:
                values[name] = _positive(value, f"{where}.{name}")
        limits = replace(base, **values)
        if limits.burst_requests is not None and limits.requests_per_s is None:
            if values.get("burst_requests") is not None:  # written here: a burst without a bucket would be ignored
                raise ConfigError(f"{where}.burst_requests: needs requests_per_s (the rate that refills the burst)")
            limits = replace(limits, burst_requests=None)  # inherited, its rate lifted here: no bucket, no burst
        return limits


def _sorted_keys(keys: set) -> list:
    """Keys of a mapping a config file holds, sorted for a message: YAML keys may mix types (`1:`, `foo:`),
    which `sorted` alone cannot compare."""
    return sorted(keys, key=lambda k: (type(k).__name__, str(k)))


# Limits that count whole things (prompt tokens, requests at once): integers.
_COUNT_LIMITS = ("max_prompt_tokens", "max_concurrent")


def _positive(value: Any, where: str) -> float:
    """A positive finite number, else ConfigError: NaN compares false with every bound, so it would pass a
    `<= 0` check and lift the limit it stands for; infinity (or an int past float's range) is no limit
    either, and null is how a config says that."""
    if not finite_number(value) or value <= 0:
        raise ConfigError(f"{where}: expected a positive finite number or null, got {brief(repr(value))}")
    return value


# The slowest requests_per_s a config may set: one request in about 11.6 days. Slower is no rate but a lockout
# (1e-310 made the wait infinite and the Retry-After an OverflowError); null lifts the limit, and a tenant to
# refuse is revoked, not rated.
MIN_REQUESTS_PER_S = 1e-6


def _at_least(value: Any, where: str, low: float, meaning: str = "") -> float:
    """A finite number of at least `low`, else ConfigError (`meaning`: what `low` stands for, in the message).
    requests_per_s: MIN_REQUESTS_PER_S. A bucket's size: 1; a request bucket's burst (each request takes 1)
    or a tokens_per_min budget (a text prompt is counted as at least 1 token before it is tokenised) below 1
    could never admit a request, so the tenant would be refused for good while told to retry in 1 s or 60 s;
    a fraction above 1 is a bucket size like any other (the default burst, max(1, requests_per_s), may be one)."""
    if not finite_number(value) or value < low:
        raise ConfigError(f"{where}: expected a finite number >= {low:g}{meaning} or null, got {brief(repr(value))}")
    return float(value)


def _integer(value: Any, where: str) -> int:
    """An integer, negative too (a float with no fraction counts), else ConfigError."""
    if not finite_number(value) or int(value) != value:
        raise ConfigError(f"{where}: expected an integer or null, got {brief(repr(value))}")
    return int(value)


def _count(value: Any, where: str) -> int:
    """A positive integer (a float with no fraction counts), else ConfigError."""
    if not finite_number(value) or value < 1 or int(value) != value:
        raise ConfigError(f"{where}: expected a positive integer or null, got {brief(repr(value))}")
    return int(value)


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated tenant. `salt` is what the engine sees as `cache_salt`; keep it out of logs."""

    id: str
    group: str | None
    salt: str = field(repr=False)
    limits: Limits = Limits()
    # may read what spans tenants (`/kvmesh/state`, any request's `/kvmesh/explain`, index lookups)
    operator: bool = False


def hash_api_key(api_key: str) -> str:
    """SHA-256 hex of a key. Keys are long random tokens, so a fast hash suffices (no dictionary attack)."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    """A fresh random key (256 bits), in the shape `authenticate` accepts."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def derive_salt(secret: bytes, tenant_id: str, group: str | None = None) -> str:
    """HMAC-SHA256(secret, scope) hex, scope = group if set else tenant id (domain-separated)."""
    scope = f"group:{group}" if group else f"tenant:{tenant_id}"
    return hmac.new(secret, _SALT_DOMAIN + b"\0" + scope.encode("utf-8"), hashlib.sha256).hexdigest()


def resolve_secret(
    secret: bytes | str | None = None,
    secret_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> bytes:
    """The server secret: explicit value, else $KVMESH_SALT_SECRET, else $KVMESH_SALT_SECRET_FILE, else
    `secret_file`, else a random one generated for this process (local runs: caches then do not
    survive a restart, which is safe)."""
    env = os.environ if env is None else env
    source = "argument"
    if secret is None and env.get(SECRET_ENV):
        # blanks around it dropped, as a secret file's are: one value salts alike by either way in
        secret, source = env[SECRET_ENV].strip(), SECRET_ENV
    if secret is None:
        path = env.get(SECRET_FILE_ENV) or secret_file
        if path:
            try:
                secret = Path(path).read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read salt secret file {path}: {exc.strerror}") from None
            source = str(path)
    if secret is None:
        log.warning("no %s set: generated an ephemeral salt secret (cache salts change on restart)", SECRET_ENV)
        return secrets.token_bytes(32)
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    check_secret(secret, source)
    return secret


def check_secret(secret: bytes, source: str) -> None:
    """A salt secret the server may use (ConfigError naming `source`): not a published placeholder (a pod's
    secret file too: salts from a published value are anyone's) and at least MIN_SECRET_BYTES long."""
    from kvmesh.deployments.salt_secret import check_not_placeholder

    check_not_placeholder(secret, source)
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"salt secret from {source} is too short: need at least {MIN_SECRET_BYTES} bytes, e.g. from "
            "`openssl rand -hex 32`"
        )


def write_secret_file(secret: bytes | str, directory: str | os.PathLike) -> Path:
    """Write the salt secret to a new owner-only (0600) file and return its path.

    Why: a secret passed as an environment variable through Ray's runtime_env is written verbatim into
    Ray's runtime_env_agent.log; passing KVMESH_SALT_SECRET_FILE (a path) keeps it out of every log.
    """
    from kvmesh.cluster.secure_channel import write_secret_file as write_private

    data = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"salt secret is too short: need at least {MIN_SECRET_BYTES} bytes")
    return write_private(directory, "salt-secret", data)


@dataclass(slots=True)
class _KeyEntry:
    digest: bytes  # sha256 of the key
    tenant: Tenant
    revoked: bool


def _parse_bearer(header: str | None) -> str:
    if header is None or not header.strip():
        raise AuthError("Missing API key: send it as 'Authorization: Bearer <key>'.", "missing_api_key")
    parts = header.strip().split(None, 1)  # RFC 6750: "Bearer" 1*SP b64token
    if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1]:
        raise AuthError("Malformed Authorization header: expected 'Bearer <key>'.", "invalid_api_key")
    if not _TOKEN.fullmatch(parts[1]):
        raise AuthError("Malformed API key.", "invalid_api_key")
    return parts[1]


def _config_secret_file(raw: Any, base_dir: Path | None) -> str | Path | None:
    """The config's `secret_file`, relative to the config's folder; None when it names none."""
    secret_file = raw.get("secret_file") if isinstance(raw, Mapping) else None
    if secret_file is None:
        return None
    if not isinstance(secret_file, str):
        raise ConfigError(
            f"secret_file: expected the salt secret file's path (a string), got {brief(repr(secret_file))}"
        )
    if not secret_file:
        return None
    if base_dir is not None and not Path(secret_file).is_absolute():
        return base_dir / secret_file
    return secret_file


def config_secret_file(path: str | os.PathLike) -> str | Path | None:
    """The salt secret file the tenants file at `path` names (`secret_file`, relative to its folder), or None;
    ConfigError naming the file when it cannot be read or parsed, or its `secret_file` is no path."""
    path = Path(path)
    return _file_secret_file(_parse_tenants_text(path, _read_tenants_text(path)), path)


def _file_secret_file(raw: Any, path: Path) -> str | Path | None:
    """`_config_secret_file` of the tenants file at `path`, its errors naming the file."""
    try:
        return _config_secret_file(raw, path.parent)
    except ConfigError as exc:
        raise ConfigError(f"tenants file {path}: {exc}") from None


def _read_tenants_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read tenants file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # a ValueError, but not one with this module's one-line message
        raise ConfigError(f"cannot read tenants file {path}: not UTF-8 text (byte {exc.start})") from None
    return text


def _parse_tenants_text(path: Path, text: str) -> Any:
    try:
        if path.suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if path.suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as exc:  # parser errors differ per format; report one line
        raise ConfigError(f"cannot parse tenants file {path}: {_parse_problem(exc)}") from None


def _parse_problem(exc: Exception) -> str:
    """A parser's error in one line, with its position: YAML's message spans lines, and its first names
    only the construct being read ("while parsing a block mapping"), not where it failed. JSON's and TOML's
    first line carries the position already."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1} column {mark.column + 1}: {problem}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _digest_of(path: str | os.PathLike | None) -> str | None:
    """sha256 of a file's bytes (following symlinks), or why it cannot be read: what `refresh` compares."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


@dataclass(slots=True)
class _FileWatch:
    """What a registry loaded from a file needs to follow it. Why: Kubernetes rewrites a mounted Secret's
    files in place (a symlink swap), and the ingress builds its registry once, so a key revoked or a salt
    secret rotated there would otherwise never take effect: neither an identical `serve deploy` nor an
    unchanged RayService restarts the ingress."""

    path: Path
    secret: bytes | str | None  # the argument, or the secret generated at the first load (kept: same salts)
    secret_path: str | os.PathLike | None  # the salt secret file the config in use was salted from
    interval_s: float
    clock: Callable[[], float]
    seen: tuple[str | None, str | None]  # digests (or read errors) of the tenants and secret files
    next_check: float
    lock: threading.Lock = field(default_factory=threading.Lock)

    def look(self) -> tuple[str | None, str | None]:
        return _digest_of(self.path), _digest_of(self.secret_path)


class TenantRegistry:
    """API-key digests -> tenants. One built by `from_file` follows the file (`refresh`); others are fixed."""

    def __init__(self, secret: bytes, entries: list[_KeyEntry], admission: Mapping[str, Any] | None = None):
        self._entries = entries
        self._secret_fingerprint = hashlib.sha256(b"fp" + secret).hexdigest()[:12]
        self.admission_config = dict(admission or {})
        self.tenants: dict[str, Tenant] = {}
        for entry in entries:
            self.tenants.setdefault(entry.tenant.id, entry.tenant)
        self._watch: _FileWatch | None = None

    def __repr__(self) -> str:
        return (
            f"TenantRegistry({len(self.tenants)} tenants, {len(self._entries)} keys, "
            f"secret fp {self._secret_fingerprint})"
        )

    @property
    def secret_fingerprint(self) -> str:
        """A non-reversible id of the secret in use, for logs and rotation checks."""
        return self._secret_fingerprint

    @classmethod
    def single_key(
        cls, api_key: str, secret: bytes | str | None = None, tenant_id: str = "default", limits: Limits | None = None
    ) -> TenantRegistry:
        """One tenant with one key: what `kvmesh serve --api-key KEY` runs with (the operator: there is no
        one else)."""
        if not isinstance(api_key, str) or not _TOKEN.fullmatch(api_key):
            raise ConfigError("API key must be 8-256 characters of [A-Za-z0-9._~+/=-]")
        return cls.one_tenant([api_key], secret=secret, tenant_id=tenant_id, limits=limits)

    @classmethod
    def one_tenant(
        cls,
        api_keys: Sequence[str],
        secret: bytes | str | None = None,
        tenant_id: str = "default",
        limits: Limits | None = None,
    ) -> TenantRegistry:
        """One tenant holding every key (config `api_keys`), its operator too: there is no one else."""
        keys = [{"sha256": hash_api_key(k)} for k in api_keys]
        return cls.from_dict(
            {"tenants": [{"id": tenant_id, "keys": keys, "limits": None, "operator": True}]},
            secret=secret,
            default_limits=limits,
        )

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        secret: bytes | str | None = None,
        *,
        reload_interval_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> TenantRegistry:
        """Load YAML (.yaml/.yml), TOML (.toml) or JSON (.json). The registry then follows the file and the
        salt secret file it was salted from (`refresh`, at most every `reload_interval_s` of `clock`:
        RELOAD_INTERVAL_S of time.monotonic, read at the call)."""
        path = Path(path)
        interval_s = RELOAD_INTERVAL_S if reload_interval_s is None else reload_interval_s
        clock = clock or time.monotonic
        tenants_digest = _digest_of(path)  # before reading: a change after it is seen at the next look
        raw = _parse_tenants_text(path, _read_tenants_text(path))
        secret_path = None
        if secret is None and not os.environ.get(SECRET_ENV):
            secret_path = os.environ.get(SECRET_FILE_ENV) or _file_secret_file(raw, path)
            if not secret_path and isinstance(
                raw, Mapping
            ):  # generated: once per process, or every reload would change every salt
                secret = resolve_secret()
        seen = (tenants_digest, _digest_of(secret_path))
        registry = cls._from_raw(path, raw, secret)
        registry._watch = _FileWatch(path, secret, secret_path, interval_s, clock, seen, clock() + interval_s)
        return registry

    @classmethod
    def _from_raw(cls, path: Path, raw: Any, secret: bytes | str | None) -> TenantRegistry:
        try:
            registry = cls.from_dict(raw, secret=secret, base_dir=path.parent)
        except ConfigError as exc:  # the key at fault is named in the message; the file, only here
            raise ConfigError(f"tenants file {path}: {exc}") from None
        if path.resolve() != SHIPPED_EXAMPLE.resolve():
            registry._refuse_published_keys(path)
        return registry

    def refresh(self) -> bool:
        """Reload from the file when its content or the salt secret file's changed since the last look, at most
        once per reload interval (`authenticate` calls it: a read of two small files every few seconds).
        True when a new config took effect. A file that cannot be read or is not a valid config keeps the
        config in use (one error logged per change): a broken edit must neither open access nor lock
        every tenant out."""
        watch = self._watch
        if watch is None:
            return False
        now = watch.clock()
        if now < watch.next_check or not watch.lock.acquire(blocking=False):
            return False
        try:
            watch.next_check = now + watch.interval_s
            seen = watch.look()
            if seen == watch.seen:
                return False
            watch.seen = seen
            try:
                raw = _parse_tenants_text(watch.path, _read_tenants_text(watch.path))
                secret_path = watch.secret_path
                if watch.secret is None and not os.environ.get(SECRET_ENV):
                    secret_path = os.environ.get(SECRET_FILE_ENV) or _file_secret_file(raw, watch.path)
                    if not secret_path:  # salted from a file: an edit dropping it would salt with a random one
                        raise ConfigError(
                            "it names no salt secret (secret_file) where the config in use was salted from one: "
                            "a secret generated here would change every tenant's salt, differently on each replica"
                        )
                new = self._from_raw(watch.path, raw, watch.secret)
            except Exception as exc:  # ConfigError, or anything else: a request must not fail for it
                log.error(
                    "tenants file %s or its salt secret changed but cannot be used, still serving the config "
                    "loaded before (%d tenants, secret fp %s): %s",
                    watch.path,
                    len(self.tenants),
                    self._secret_fingerprint,
                    exc,
                )
                return False
            if new.admission_config != self.admission_config:  # kept: what the ingress's Admission was built from
                log.warning(
                    "tenants file %s: a changed `admission:` takes effect when the ingress restarts", watch.path
                )
            if secret_path != watch.secret_path:  # the config names another salt secret file: follow that one
                watch.secret_path, watch.seen = secret_path, (seen[0], _digest_of(secret_path))
            self._entries, self.tenants = new._entries, new.tenants
            self._secret_fingerprint = new._secret_fingerprint
            log.warning("reloaded tenants file %s (changed on disk): %s", watch.path, self)  # seen in Serve's logs
            return True
        finally:
            watch.lock.release()

    def _refuse_published_keys(self, path: Path) -> None:
        """ConfigError naming the first tenant that holds a key kvmesh's examples publish."""
        for entry in self._entries:
            if entry.digest.hex() in PUBLISHED_KEY_DIGESTS:
                raise ConfigError(
                    f"tenants file {path}: tenant {entry.tenant.id!r} has a key published in kvmesh's examples "
                    "(k8s/tenants-secret.example.yaml): anyone can use it; make keys with "
                    "`python -m kvmesh.deployments.tenants new-key`"
                )

    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any],
        secret: bytes | str | None = None,
        base_dir: Path | None = None,
        default_limits: Limits | None = None,
    ) -> TenantRegistry:
        if not isinstance(raw, Mapping):
            raise ConfigError("tenants config: expected a mapping at the top level")
        unknown = set(raw) - {"secret_file", "defaults", "admission", "tenants"}
        if unknown:
            raise ConfigError(f"tenants config: unknown top-level key(s) {_sorted_keys(unknown)}")
        secret_bytes = resolve_secret(secret, _config_secret_file(raw, base_dir))
        defaults = raw.get("defaults") or {}
        if not isinstance(defaults, Mapping) or set(defaults) - {"limits"}:
            raise ConfigError("defaults: expected a mapping with only 'limits'")
        base = Limits.from_dict(defaults.get("limits"), default_limits or Limits(), "defaults.limits")
        tenants = raw.get("tenants")
        if not isinstance(tenants, list) or not tenants:
            raise ConfigError("tenants: expected a non-empty list")
        entries: list[_KeyEntry] = []
        seen_ids: set[str] = set()
        seen_digests: set[str] = set()
        for i, item in enumerate(tenants):
            where = f"tenants[{i}]"
            if not isinstance(item, Mapping):
                raise ConfigError(f"{where}: expected a mapping")
            unknown = set(item) - {"id", "group", "keys", "limits", "operator"}
            if unknown:
                raise ConfigError(f"{where}: unknown key(s) {_sorted_keys(unknown)}")
            tid, group = item.get("id"), item.get("group")
            if not isinstance(tid, str) or not _TENANT_ID.fullmatch(tid):
                raise ConfigError(f"{where}.id: expected 1-64 chars of [A-Za-z0-9._-], got {brief(repr(tid))}")
            if tid in RESERVED_TENANT_IDS:
                raise ConfigError(
                    f"{where}.id: {tid!r} is reserved (the ingress counts requests of no configured tenant "
                    "under it): choose another id"
                )
            if tid in seen_ids:
                raise ConfigError(f"{where}.id: duplicate tenant id {tid!r}")
            seen_ids.add(tid)
            if group is not None and (not isinstance(group, str) or not _TENANT_ID.fullmatch(group)):
                raise ConfigError(f"{where}.group: expected 1-64 chars of [A-Za-z0-9._-], got {brief(repr(group))}")
            limits = Limits.from_dict(item.get("limits"), base, f"{where}.limits")
            operator = item.get("operator", False)
            if not isinstance(operator, bool):
                raise ConfigError(f"{where}.operator: expected true or false")
            salt = derive_salt(secret_bytes, tid, group)
            tenant = Tenant(id=tid, group=group, salt=salt, limits=limits, operator=operator)
            keys = item.get("keys")
            if not isinstance(keys, list) or not keys:
                raise ConfigError(f"{where}.keys: expected a non-empty list of {{sha256: <hex>}}")
            for j, key in enumerate(keys):
                kwhere = f"{where}.keys[{j}]"
                if not isinstance(key, Mapping) or set(key) - {"sha256", "revoked", "note"}:
                    raise ConfigError(f"{kwhere}: expected {{sha256: <hex>, revoked: bool, note: str}}")
                digest = key.get("sha256")
                if not isinstance(digest, str) or not _HEX64.fullmatch(digest.lower()):
                    raise ConfigError(f"{kwhere}.sha256: expected 64 hex digits (the key's SHA-256, never the key)")
                digest = digest.lower()
                if digest in seen_digests:
                    raise ConfigError(f"{kwhere}: the same key is listed twice")
                seen_digests.add(digest)
                revoked = key.get("revoked", False)
                if not isinstance(revoked, bool):
                    raise ConfigError(f"{kwhere}.revoked: expected true or false")
                entries.append(_KeyEntry(bytes.fromhex(digest), tenant, revoked))
        admission = raw.get("admission") or {}
        if not isinstance(admission, Mapping) or set(admission) - {"max_concurrent", "queue_timeout_s"}:
            raise ConfigError("admission: expected a mapping with max_concurrent, queue_timeout_s")
        admission = dict(admission)
        if admission.get("max_concurrent") is not None:
            admission["max_concurrent"] = _count(admission["max_concurrent"], "admission.max_concurrent")
        if "queue_timeout_s" in admission:  # null is not "no timeout": the queue's wait must be bounded
            timeout = admission["queue_timeout_s"]  # 0: never queue, a full server answers at once
            if not finite_number(timeout) or timeout < 0:
                got = brief(repr(timeout))
                raise ConfigError(f"admission.queue_timeout_s: expected a finite number >= 0, got {got}")
        return cls(secret_bytes, entries, admission)

    def authenticate(self, authorization: str | None) -> Tenant:
        """`Authorization` header value -> Tenant, or AuthError. Compares every stored digest in constant
        time and does not stop early, so timing reveals neither which key nor how much matched. A registry
        from a file first looks whether the file changed (`refresh`)."""
        self.refresh()
        token = _parse_bearer(authorization)
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found: _KeyEntry | None = None
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, digest) and found is None:
                found = entry
        if found is None:
            raise AuthError("Incorrect API key provided.", "invalid_api_key")
        if found.revoked:
            raise AuthError("This API key has been revoked.", "revoked_api_key")
        return found.tenant


# Body fields and headers through which a client could try to pick a salt or impersonate a tenant.
CLIENT_SALT_FIELDS = ("cache_salt", "kvmesh_tenant", "tenant_id", "kvmesh_salt")
CLIENT_TENANT_HEADERS = ("x-kvmesh-tenant", "x-kvmesh-salt", "x-kvmesh-cache-salt", "x-tenant-id", "x-cache-salt")


def reject_client_salt(body: Any, headers: Mapping[str, str] | None = None) -> None:
    """Raise ClientSaltError if the request tries to set its own cache salt or tenant.

    Why reject rather than drop: a client that sends `cache_salt` expects isolation semantics it is not
    getting from its own value; a clear 400 says the server owns salts. Headers are matched
    case-insensitively.
    """
    if isinstance(body, Mapping):
        for name in CLIENT_SALT_FIELDS:
            if name in body:
                raise ClientSaltError(
                    f"'{name}' is set by the server from your API key and may not be sent.",
                    "client_cache_salt_not_allowed",
                )
    if headers:
        present = {str(k).lower() for k in headers.keys()}
        for name in CLIENT_TENANT_HEADERS:
            if name in present:
                raise ClientSaltError(
                    f"Header '{name}' is not accepted: the tenant comes from your API key.",
                    "client_tenant_header_not_allowed",
                )


def _main(argv: list[str]) -> int:
    """Tiny operator helper: `new-key` prints a key and its digest; `hash-key` hashes stdin's key."""
    if argv == ["new-key"]:
        key = new_api_key()
        print(f"key:    {key}\nsha256: {hash_api_key(key)}")
        return 0
    if argv == ["hash-key"]:
        key = sys.stdin.readline().strip()
        if not key:
            print("error: no key on stdin", file=sys.stderr)
            return 2
        print(hash_api_key(key))
        return 0
    if argv == ["new-secret"]:
        print(secrets.token_hex(32))
        return 0
    print("usage: python -m kvmesh.deployments.tenants new-key | hash-key (< key) | new-secret", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

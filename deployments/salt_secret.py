"""The salt secret of a local run when none is configured: generated once, kept in a private file under
KVMESH_HOME, and reused by every later run.

Why kept: tenant salts are derived from the secret, and LMCache keys carry the salt, so a new secret per
run would make everything a persistent shared tier (Redis, fs) holds from earlier runs unreachable.
Rotation stays an explicit operator action (docs/tenants.md): replace or delete the file. A configured
secret that is the published examples' placeholder (REPLACE-..., k8s/secrets.example.yaml) is refused.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

FILE_NAME = "salt-secret"


def check_not_placeholder(secret: str | bytes, where: str) -> None:
    """Refuse a salt secret copied from a published example: salts derived from it are known to anyone, so
    one tenant could compute another's salt (ConfigError naming `where`)."""
    from kvmesh.cluster.secure_channel import PLACEHOLDER_PREFIX
    from kvmesh.deployments.config import ConfigError

    raw = secret.encode("utf-8") if isinstance(secret, str) else secret
    if raw.strip().startswith(PLACEHOLDER_PREFIX):
        raise ConfigError(
            f"salt secret ({where}) is the example's placeholder ({PLACEHOLDER_PREFIX.decode()}...): create it from "
            "random bytes, e.g. `openssl rand -hex 32` (docs/kubernetes.md)"
        )


def check_usable_secret(env: Mapping[str, str], *, file_is_here: bool = True) -> None:
    """The checks the replicas' `tenants.resolve_secret` makes of the salt secret `env` configures, made
    before anything starts (ConfigError): KVMESH_SALT_SECRET is not the placeholder and is long enough; else the
    file KVMESH_SALT_SECRET_FILE names can be read, its content (blanks around it dropped, as there) is not
    the placeholder and is long enough. `file_is_here` False (a cluster joined: the file may be only on its
    nodes): a file this machine cannot read is theirs to check. No variable set: nothing to check, the
    run keeps its own secret (`persistent_secret_file`). The replicas check again as they start."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import SECRET_ENV, SECRET_FILE_ENV, check_secret

    if env.get(SECRET_ENV):  # it wins over the file, which the replicas then never read
        # blanks around it dropped: a local run hands it to its replicas in a file, read stripped
        check_secret(env[SECRET_ENV].strip().encode("utf-8"), SECRET_ENV)
        return
    path = env.get(SECRET_FILE_ENV)
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as exc:
            if not file_is_here:
                return
            raise ConfigError(
                f"cannot read salt secret file {path!r} ({SECRET_FILE_ENV}): {exc.strerror or exc}"
            ) from None
        check_secret(data, f"{SECRET_FILE_ENV} {path!r}")


def kvmesh_home() -> Path:
    """Where a local run keeps its secrets ($KVMESH_HOME, else ~/.kvmesh): the kept salt secret and the
    per-run secret files under `run/`. kvstore/tiers.py's `kvmesh_home` (the built model, the default fs
    tier) defaults to ~/.cache/kvmesh instead: a cache may be wiped, and the salt secret must not move,
    since every tenant's salt, and so every key a persistent shared tier holds, derives from it."""
    return Path(os.environ.get("KVMESH_HOME") or Path.home() / ".kvmesh")


def persistent_secret_file(explicit: str | None = None) -> Path:
    """Path of a 0600 file holding the salt secret replicas should read.

    `explicit` (a value from the environment) is written to a new per-run file, as before; otherwise the
    kept secret is used, created on first use. A kept file others can read is refused, not used.
    """
    from kvmesh.deployments.tenants import write_secret_file

    home = kvmesh_home()
    if explicit:
        check_not_placeholder(explicit, "KVMESH_SALT_SECRET")
        return write_secret_file(explicit, home / "run")
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = home / FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise PermissionError(
                f"salt secret {path} is readable by others (mode {mode:o}): chmod 600 it, or delete it to start over"
            ) from None
        return path
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    return path

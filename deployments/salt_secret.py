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
    the placeholder and is long enough. `file_is_here` False (a cluster joined with nodes elsewhere: the file
    may be only on its nodes): a file this machine cannot read is theirs to check, and KVMESH_SALT_SECRET
    alone is refused (the per-run file made of it would be on this machine only). No variable set: nothing
    to check, the run keeps its own secret (`persistent_secret_file`). The replicas check again as they start."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import SECRET_ENV, SECRET_FILE_ENV, check_secret

    if env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV) and not file_is_here:
        raise ConfigError(
            f"{SECRET_ENV} is set here, but the Ray cluster joined has nodes elsewhere: they cannot read a file "
            "written on this machine, and the value itself is never handed to Ray (its logs keep runtime "
            f"environments). Put the secret in a file on every node and set {SECRET_FILE_ENV} to its path "
            f"(or `secret_file:` in the tenants file), or unset {SECRET_ENV} here to use the nodes' own"
        )
    if env.get(SECRET_ENV):  # it wins over the file, which the replicas then never read
        # blanks around it dropped, as the replicas drop them (`tenants.resolve_secret`)
        check_secret(env[SECRET_ENV].strip().encode("utf-8"), SECRET_ENV)
        return
    path = env.get(SECRET_FILE_ENV)
    if path:
        check_secret_file(path, SECRET_FILE_ENV, file_is_here=file_is_here)


def check_secret_file(path: str | os.PathLike, where: str, *, file_is_here: bool = True) -> None:
    """The replicas' checks of the salt secret file at `path` (`where`: what named it, for the ConfigError):
    readable, its content (blanks around it dropped) not the placeholder and long enough. `file_is_here`
    False: a file this machine cannot read is left to the cluster's nodes."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import check_secret

    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        if not file_is_here:
            return
        raise ConfigError(f"cannot read salt secret file {str(path)!r} ({where}): {exc.strerror or exc}") from None
    check_secret(data, f"{where} {str(path)!r}")


def kvmesh_home() -> Path:
    """Where a local run keeps its secrets ($KVMESH_HOME, else ~/.kvmesh): the kept salt secret and the
    per-run secret files under `run/`. kvstore/tiers.py's `kvmesh_home` (the built model, the default fs
    tier) defaults to ~/.cache/kvmesh instead: a cache may be wiped, and the salt secret must not move,
    since every tenant's salt, and so every key a persistent shared tier holds, derives from it."""
    return Path(os.environ.get("KVMESH_HOME") or Path.home() / ".kvmesh")


def persistent_secret_file(explicit: str | None = None) -> Path:
    """Path of a 0600 file holding the salt secret replicas should read.

    `explicit` (a value from the environment) is written to a new per-run file, as before; otherwise the
    kept secret is used, created on first use. A kept file others can read is refused, not used; so is one
    the replicas would refuse (empty, short, the placeholder: ConfigError), before anything starts.
    """
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import write_secret_file

    home = kvmesh_home()
    if explicit:
        check_not_placeholder(explicit, "KVMESH_SALT_SECRET")
        return write_secret_file(explicit, home / "run")
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = home / FILE_NAME
    if not path.exists():
        _create_kept(path, home / "run")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(
            f"salt secret {path} is readable by others (mode {mode:o}): chmod 600 it, or delete it to start over"
        )
    try:
        check_secret_file(path, "the kept file")
    except ConfigError as exc:  # nothing can have been salted from it: the replicas refuse it too
        raise ConfigError(f"{exc} (or delete it: the next run makes a new one)") from None
    return path


def _create_kept(path: Path, staging: Path) -> None:
    """Make the kept secret at `path`, whole, unless another run made it first (the first one made wins).
    Why staged: written in place, it could be read, or left by a run killed meanwhile, empty or half
    written; here it is written to a private file of its own under `staging` (one a dead run left is
    removed with its per-run secrets), then linked in under its name at once, which fails if one is there.
    A filesystem without hard links (some FUSE, SMB or vfat mounts: EPERM, ENOTSUP) gets it created in place,
    exclusively, as before the staging (`_create_kept_in_place`): the first one made still wins."""
    from kvmesh.cluster.secure_channel import write_secret_file as write_private

    data = secrets.token_hex(32).encode("ascii")
    staged = write_private(staging, FILE_NAME, data)
    try:
        os.link(staged, path)
    except FileExistsError:
        pass  # another run's came first: every run uses that one
    except OSError:
        _create_kept_in_place(path, data)
    finally:
        staged.unlink(missing_ok=True)


def _create_kept_in_place(path: Path, data: bytes) -> None:
    """Write `data` to a new 0600 file at `path` unless one is there (another run's came first), flushed to
    disk before it is closed. One that cannot be written whole is removed, not left empty or short."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise

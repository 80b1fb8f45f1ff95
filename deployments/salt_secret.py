"""The salt secret of a local run when none is configured: generated once, kept in a private file under
KVMESH_HOME, and reused by every later run.

Why kept: tenant salts are derived from the secret, and LMCache keys carry the salt, so a new secret per
run would make everything a persistent shared tier (Redis, fs) holds from earlier runs unreachable.
Rotation stays an explicit operator action (docs/tenants.md): replace or delete the file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FILE_NAME = "salt-secret"


def kvmesh_home() -> Path:
    return Path(os.environ.get("KVMESH_HOME") or Path.home() / ".kvmesh")


def persistent_secret_file(explicit: str | None = None) -> Path:
    """Path of a 0600 file holding the salt secret replicas should read.

    `explicit` (a value from the environment) is written to a new per-run file, as before; otherwise the
    kept secret is used, created on first use. A kept file others can read is refused, not used.
    """
    from kvmesh.deployments.tenants import write_secret_file

    home = kvmesh_home()
    if explicit:
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

"""Folders only kvmesh's own user can enter, and the sweeps that remove those of owners that died.

`private_dir`/`check_private_dir`: the LMCache server's sockets and a local fs shared tier. Why: a unix
socket in a folder other users can enter is theirs to connect to, and a file there theirs to read; a folder
someone else made first (a predictable name in a shared temp folder) is theirs to watch or swap. kvmesh
makes such folders 0700 and refuses one that is not a plain folder of its own user closed to group and
others.

`owned_temp_dir`, `owner_tag`, `owner_gone`, `remove_dead_owners_dirs`: the per-process folders of local
Ray clusters (deployments/local_ray.py), engine replicas (deployments/engine.py) and LMCache servers carry
their owner's pid and tag, and so do a run's HAProxy folder and its secret files (deployments/app.py,
cluster/secure_channel.py). Why: an owner killed outright never removes its own, so a later run sweeps
what dead owners left, judging only pids of its own pid namespace, boot and host.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

# In a folder `owned_temp_dir` made (and a run's HAProxy folder): the `owner_tag` of the process that made it.
OWNER_TAG_FILE = ".kvmesh-owner"


class PrivateDirError(RuntimeError):
    """A folder kvmesh keeps private is not: the message says whose it is or what is open."""


def private_dir(path: str | os.PathLike) -> Path:
    """Make `path` (mode 0700) unless it exists, then check it is private (`check_private_dir`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass  # made earlier (by us, or by someone else: the check tells)
    check_private_dir(path)
    return path


def check_private_dir(path: str | os.PathLike) -> None:
    """Raise PrivateDirError unless `path` is a folder (not a link to one) owned by this process's user with
    no permission for group or others."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{path} must be a folder of kvmesh's own, not a link or a file")
    if st.st_uid != os.geteuid():
        raise PrivateDirError(f"{path} belongs to uid {st.st_uid}, not to kvmesh's user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise PrivateDirError(
            f"{path} is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}); make it 0700 (chmod 700)"
        )


@functools.cache
def owner_tag() -> str:
    """8 hex characters naming this process's pid namespace on this boot of this host: the same for every
    process that can see (and `os.kill(pid, 0)`) the others' pids, different for a container's or another
    host's (sharing /tmp or an NFS home). Why: a pid means a process only where the tag is the same, so the
    dead-owner sweeps judge only owners with our tag. Parts /proc lacks (not Linux) count as empty."""
    parts = []
    for read in (
        lambda: str(os.stat("/proc/self/ns/pid").st_ino),
        lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        socket.gethostname,
    ):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def write_owner_tag(folder: str | os.PathLike) -> None:
    """Record this process's `owner_tag` in `folder` (OWNER_TAG_FILE) for the dead-owner sweeps."""
    with open(os.path.join(folder, OWNER_TAG_FILE), "w", encoding="ascii") as fh:
        fh.write(owner_tag())


def foreign_owner(folder: str | os.PathLike) -> bool:
    """Was `folder` made in another pid namespace or on another host (its OWNER_TAG_FILE holds another
    tag)? Its owner's pid then says nothing here. A folder without the file (made before kvmesh wrote it,
    or its owner died before it could) is not foreign: its pid is judged as before."""
    try:
        with open(os.path.join(folder, OWNER_TAG_FILE), encoding="ascii", errors="replace") as fh:
            tag = fh.read().strip()
    except OSError:
        return False
    return tag != owner_tag()


def owned_temp_dir(prefix: str, root: str) -> str:
    """A new 0700 folder (mkdtemp) `<root>/<prefix><this pid>-XXXXXXXX` holding this process's `owner_tag`,
    for `remove_dead_owners_dirs`."""
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
    write_owner_tag(path)
    return path


def owner_gone(pid: int) -> bool:
    """Whether no process `pid` runs in this pid namespace (another user's process counts as running). The one
    judgement every dead-owner sweep makes; `owner_tag` says whether the pid is one of this namespace's."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: another user's process
        return False
    return False


def remove_dead_owners_dirs(prefix: str, root: str = "/tmp", keep_marked: str | None = None) -> int:
    """Remove this user's folders `<prefix><owner pid>-*` under `root` whose owner process is gone: an owner
    killed outright (SIGKILL, Serve ending a replica) never removes its own. A folder another pid namespace
    or host made (`foreign_owner`) is kept: its pid is not one this process can see, and so is one holding a
    file named `keep_marked` (a failed start's kept logs). Returns how many were removed."""
    removed = 0
    for entry in os.scandir(root):
        pid = entry.name.removeprefix(prefix).split("-", 1)[0]
        if not entry.name.startswith(prefix) or not pid.isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid() or foreign_owner(entry.path):
                continue  # not ours to judge
        except OSError:  # gone meanwhile
            continue
        if keep_marked is not None and os.path.exists(os.path.join(entry.path, keep_marked)):
            continue
        if owner_gone(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed

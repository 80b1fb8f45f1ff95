"""Folders only kvmesh's own user can enter: the LMCache server's sockets and a local fs shared tier.

Why: a unix socket in a folder other users can enter is theirs to connect to, and a file there theirs to
read; a folder someone else made first (a predictable name in a shared temp folder) is theirs to watch or
swap. kvmesh makes such folders 0700 and refuses one that is not a plain folder of its own user closed to
group and others.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path


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


def remove_dead_owners_dirs(prefix: str, root: str = "/tmp") -> int:
    """Remove this user's folders `<prefix><owner pid>-*` under `root` whose owner process is gone: an owner
    killed outright (SIGKILL, Serve ending a replica) never removes its own. Returns how many were removed."""
    removed = 0
    for entry in os.scandir(root):
        pid = entry.name.removeprefix(prefix).split("-", 1)[0]
        if not entry.name.startswith(prefix) or not pid.isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue  # not ours to judge
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
        except OSError:  # gone meanwhile, or the pid is another user's process (alive)
            continue
    return removed

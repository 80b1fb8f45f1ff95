"""Writing a file whole or not at all: an output cut short by a full disk or an interrupt would replace an
earlier good file with one that no reader can parse."""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """A file object that writes `path` whole or not at all: the block writes a temporary file in the same
    folder, which replaces `path` (`os.replace`) when the block ends without an error and is removed when it
    raises (a full disk, an interrupt): an earlier file at `path` is then left as it was, never cut short.
    Makes the missing folders. `mode` "w" (text, `encoding`) or "wb" (bytes).

    A path that exists and is not a regular file (/dev/stdout, /dev/null, a FIFO) is written in place:
    replacing it would put a file where the device or pipe was. A link is followed: the file it names is
    replaced, the link kept. The new file gets the old one's permissions, or a new file's (umask applied).
    An error opening or replacing names `path`, not the temporary file."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    encoding = None if mode == "wb" else encoding
    path = os.fspath(path)
    try:
        st = os.stat(path)  # the kernel follows links: /dev/stdout is a link to a pipe no path names
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, mode, encoding=encoding) as fh:
            yield fh
        return
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    tmp = os.path.join(folder, f".{os.path.basename(target)[:50]}.{uuid.uuid4().hex[:12]}.tmp")  # <= 255 bytes
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to open(path, "w")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None
    try:
        with open(fd, mode, encoding=encoding) as fh:
            if st is not None:
                os.chmod(fh.fileno(), stat.S_IMODE(st.st_mode))
            yield fh
            fh.flush()
            os.fsync(fh.fileno())  # a full disk some file systems report only here, not at write
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

"""OS-level names for the threads kvmesh starts, so per-thread CPU can be told apart from outside.

Why: Python 3.11 names a thread for Python only. Inside a Ray worker every Python thread carries the
name its process had when the thread began (`ray::IDLE`), so `top -H`, `/proc/<pid>/task/*/comm` and
`benchmarks/cpu_split.py` cannot tell an engine replica's vLLM step thread from Serve's event loop.
Linux keeps the first 15 bytes of a name; elsewhere naming is a no-op.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

_PR_SET_NAME = 15
OS_NAME_BYTES = 15


def name_this_thread(name: str) -> bool:
    """Name the calling thread `name` (cut to 15 bytes) in the OS; False where that is not possible."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:OS_NAME_BYTES]), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def os_thread_name(thread_id: int, pid: int | str = "self") -> str | None:
    """The OS name of thread `thread_id` (a native id) of process `pid`; None once it has ended, or
    without /proc."""
    try:
        return Path(f"/proc/{pid}/task/{thread_id}/comm").read_text().strip()
    except OSError:
        return None


LOOP_THREAD = "kvmesh-loop"
_named_loop_threads: set[int] = set()


def name_loop_thread() -> None:
    """Name the calling thread `kvmesh-loop`, once per thread. Called from request handlers: the thread
    is a Serve replica's event loop, which Serve starts and kvmesh can only name from inside it."""
    tid = threading.get_native_id()
    if tid not in _named_loop_threads:
        _named_loop_threads.add(tid)
        name_this_thread(LOOP_THREAD)

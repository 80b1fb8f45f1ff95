"""Every process a local kvmesh run starts ends with it: kernel-level parent-death signals, a child
subreaper, and a last sweep of whatever is still below the run's own process.

Why all three: Ray starts its node processes with a parent-death SIGKILL, but the processes *they* start
(Serve's HAProxy, started by a Ray worker; servers a worker spawned) are reparented to init when their
parent dies, and from then on nothing kvmesh runs can see them. A process marked as child subreaper
inherits those orphans instead of init, so after Ray shut down its own way, `end_descendants` still
finds every leftover below it and ends it. Linux only; elsewhere these are no-ops.

A stop signal must unwind the run for its clean-up to happen: `exit_on_sigterm` / `sigterm_unwinds` turn
SIGTERM into an unwinding exit (`Terminated`, a SystemExit), as Ctrl-C unwinds, for every `kvmesh` command
and benchmark; `handlers_put_back` restores the caller's handlers after code that replaces them (`ray.init`), and
`signals_seen` tells whether a signal came while such code's handler took it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphaned descendants of this process are reparented to it (not to init) from now on."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """The kernel sends `sig` to this process when the thread that started it ends."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when its parent thread dies. `parent`: the
    pid of the process that starts the child (default: this one, as it makes the preexec_fn)."""
    starter = os.getpid() if parent is None else parent

    def preexec() -> None:
        set_parent_death_signal(sig)
        end_if_parent_gone(starter)

    return preexec


def end_if_parent_gone(parent: int) -> None:
    """Call right after set_parent_death_signal: SIGKILL this process if its parent is no longer `parent`.
    Why: the kernel only signals a parent's death that comes after the prctl call; a parent that died
    between the fork and that call left an orphan that nothing would end (an orphaned HAProxy kept the
    HTTP port). The child has not started its program yet, so there is nothing to end gracefully."""
    if os.getppid() != parent:
        signal.raise_signal(signal.SIGKILL)


class Terminated(SystemExit):
    """A SIGTERM, as `exit_on_sigterm` raises it: a stop, never a command's own exit status."""


def exit_on_sigterm() -> Any:
    """From now on the first SIGTERM raises Terminated (SystemExit 143) in the main thread, and later ones are
    ignored while that unwinds. Why: Python's default ends the process at once, so none of its `finally`
    clean-up ran (a stopped run left its servers' folders, secret files and Ray behind); like Ctrl-C, a
    SIGTERM now unwinds through them. Call from the main thread; returns the handler it replaced."""

    def exit_once(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up it starts is not interrupted in turn
        raise Terminated(128 + signum)

    return signal.signal(signal.SIGTERM, exit_once)


@contextlib.contextmanager
def handlers_put_back(*signals: int, unknown: Any = None) -> Iterator[None]:
    """The handlers `signals` have on entry, set again on the way out, however the block ends. Why: what runs
    inside may replace them (Ray's `ray.init` sets its own SIGTERM handler, which logs and aborts), and the
    caller's own, put back, still runs its clean-up at a stop signal. A handler not set from Python (None to
    `signal.getsignal`) cannot be put back: `unknown` is set instead, or with None the signal keeps what it has
    then. Off the main thread, where handlers cannot be set, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None or unknown is not None:
                signal.signal(sig, unknown if handler is None else handler)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """`exit_on_sigterm` while inside, and the handler before it back afterwards (a caller in the same
    process, a test, keeps its own). Off the main thread, where handlers cannot be set, it changes nothing."""
    with handlers_put_back(signal.SIGTERM, unknown=signal.SIG_DFL):
        if threading.current_thread() is threading.main_thread():
            exit_on_sigterm()
        yield


@contextlib.contextmanager
def signals_seen() -> Iterator[Callable[[], set[int]]]:
    """Inside: a function returning the signals this process received since entry, whichever handler took
    them (Python's wakeup fd, which every Python-level handler writes the signal's number to). Why: code that
    replaces the caller's handler with its own (`ray.init`) hides that a stop signal came. An earlier wakeup
    fd is given back on the way out, with what arrived meanwhile. Off the main thread it sees nothing."""
    got: set[int] = set()
    if threading.current_thread() is not threading.main_thread():
        yield lambda: got
        return
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    data = bytearray()

    def drain() -> set[int]:
        while True:
            try:
                chunk = os.read(read_end, 512)
            except BlockingIOError:
                break
            if not chunk:
                break
            data.extend(chunk)
        got.update(data)
        return got

    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    try:
        yield drain
    finally:
        signal.set_wakeup_fd(previous)
        drain()
        if previous != -1 and data:
            try:
                os.write(previous, bytes(data))
            except OSError:
                pass
        os.close(read_end)
        os.close(write_end)


def end_descendants(grace_s: float = 5.0, exclude: Collection[int] = ()) -> list[str]:
    """SIGTERM every process below this one, SIGKILL those still alive after `grace_s`, reap them.

    Returns "name (pid)" for each process that had to be ended, so the caller can say what was left.
    """
    import psutil

    me = psutil.Process()
    try:
        procs = [p for p in me.children(recursive=True) if p.pid not in exclude]
    except psutil.Error:
        return []
    ended = []
    for p in procs:
        try:
            ended.append(f"{p.name()} ({p.pid})")
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    _reap_zombies()
    return ended


def still_running(procs: list, within_s: float) -> list:
    """Those of `procs` (psutil.Process) still running, zombies aside, after waiting up to `within_s` for
    them to end: what a stop left behind."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=within_s)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            pass
    return left


def _reap_zombies() -> None:
    """A subreaper must wait() for the orphans it inherited, or they stay as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

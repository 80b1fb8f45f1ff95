"""Engine calls abandoned when their replica left the fleet without failing them.

Why: a replica on a node that froze or was cut off keeps its calls open. Nothing errors until Ray declares
the node dead (about a minute), and a call still in flight then may never return (seen live: a unary request
answered only when the frozen node's processes resumed, 100 s later). The router hears first that Serve
dropped the replica from its set; a call to it still open `abandon_after_s` later (longer than the graceful
shutdown Serve gives a replica it stops on purpose, `engine.drain_timeout_s`) is abandoned here, and the
ingress sends the request again elsewhere (deployments/migration.py), as it does when a call fails.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Mapping

# seconds beyond an engine replica's drain time (`engine.drain_timeout_s`, Serve's graceful shutdown): a replica
# Serve stops on purpose finishes its calls within its drain time, so only calls still open after it are lost
ABANDON_MARGIN_S = 10
ABANDON_AFTER_S = 5 + ABANDON_MARGIN_S  # with the CPU engines' default drain time (deployments/config.py)


def abandon_after_s(drain_timeout_s: float | None) -> float:
    """How long after Serve dropped a replica its open calls are given up: its drain time plus a margin."""
    return ABANDON_AFTER_S if drain_timeout_s is None else float(drain_timeout_s) + ABANDON_MARGIN_S


class ReplicaGone(RuntimeError):
    """The call's replica left the fleet and the call did not end: the request is sent elsewhere."""


class OpenCalls:
    """The ingress's engine calls in flight, by engine request id, each with what abandons it and whether its
    request has a move left (`max_migrations`). `abandon` may be called from any thread (the router's loop);
    the abandoning runs on the call's own loop.

    A call is named by its `on_gone` (one per call, as `unwatch` takes it), not by its request id alone: a
    request moved before its first token is sent again under the same request id, and what was meant for
    its call on a lost replica must not abandon its new call elsewhere (`calls`, `abandon_calls`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, tuple[asyncio.AbstractEventLoop, Callable[[], None], bool]] = {}

    def watch(self, request_id: str, on_gone: Callable[[], None], movable: bool = True) -> None:
        with self._lock:
            self._calls[request_id] = (asyncio.get_running_loop(), on_gone, movable)

    def unwatch(self, request_id: str, on_gone: Callable[[], None]) -> None:
        with self._lock:
            entry = self._calls.get(request_id)
            if entry is not None and entry[1] is on_gone:
                del self._calls[request_id]

    def calls(self, request_ids: Iterable[str]) -> dict[str, Callable[[], None]]:
        """The calls open now among `request_ids` (request id -> the call's `on_gone`), for `abandon_calls`."""
        with self._lock:
            return {r: self._calls[r][1] for r in request_ids if r in self._calls}

    def abandon(self, request_ids: Iterable[str], movable_only: bool = False) -> int:
        """Abandon the calls still open among `request_ids`; how many there were. `movable_only`: not those
        whose request has no move left, which would fail with a 503 rather than wait (a suspect replica may
        answer yet; one Serve dropped will not, so its calls are abandoned either way)."""
        return self._abandon([(r, None) for r in request_ids], movable_only)

    def abandon_calls(self, calls: Mapping[str, Callable[[], None]]) -> int:
        """Abandon these calls (`calls`' answer) if still open; how many there were. A request sent again
        since under the same id has a new call, which is left alone."""
        return self._abandon(list(calls.items()), False)

    def _abandon(self, calls: list[tuple[str, Callable[[], None] | None]], movable_only: bool) -> int:
        n = 0
        for request_id, call in calls:
            with self._lock:
                entry = self._calls.get(request_id)
                if entry is None or (movable_only and not entry[2]) or (call is not None and entry[1] is not call):
                    continue
                del self._calls[request_id]
            loop, on_gone, _ = entry
            try:
                loop.call_soon_threadsafe(on_gone)
                n += 1
            except RuntimeError:  # its loop is closed: nothing left to abandon
                pass
        return n

    def __len__(self) -> int:
        return len(self._calls)

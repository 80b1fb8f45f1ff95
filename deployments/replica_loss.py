"""Engine calls abandoned when their replica left the fleet without failing them.

Why: a replica on a node that froze or was cut off keeps its calls open. Nothing errors until Ray declares
the node dead (about a minute), and a call still in flight then may never return (seen live: a unary request
answered only when the frozen node's processes resumed, 100 s later). The router hears first that Serve
dropped the replica from its set; a call to it still open ABANDON_AFTER_S later (longer than the graceful
shutdown Serve gives a replica it stops on purpose) is abandoned here, and the ingress sends the request
again elsewhere (deployments/migration.py), as it does when a call fails.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable

ABANDON_AFTER_S = 15  # seconds; an engine replica's graceful shutdown is 5 s (deploy_plan.py)


class ReplicaGone(RuntimeError):
    """The call's replica left the fleet and the call did not end: the request is sent elsewhere."""


class OpenCalls:
    """The ingress's engine calls in flight, by engine request id, each with what abandons it and whether its
    request has a move left (`max_migrations`). `abandon` may be called from any thread (the router's loop);
    the abandoning runs on the call's own loop."""

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

    def abandon(self, request_ids: Iterable[str], movable_only: bool = False) -> int:
        """Abandon the calls still open among `request_ids`; how many there were. `movable_only`: not those
        whose request has no move left, which would fail with a 503 rather than wait (a suspect replica may
        answer yet; one Serve dropped will not, so its calls are abandoned either way)."""
        n = 0
        for request_id in request_ids:
            with self._lock:
                entry = self._calls.get(request_id)
                if entry is None or (movable_only and not entry[2]):
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

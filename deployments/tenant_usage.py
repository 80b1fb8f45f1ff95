"""What the other ingress replicas placed for each tenant, as this replica's router hears it: the input that
makes a tenant's limits hold across the fleet (`kvmesh.deployments.admission`).

Why a log with times and not totals: a rate limit is a token bucket, which refills over time, so a peer's
request must be taken from this replica's bucket at the time it was placed (as heard), not when this replica
next looks. Charged late, usage from a minute ago would refuse a request now. Each tenant's log keeps the
last `window(tenant)` of (heard at, prompt tokens); a bucket this replica makes later starts full one window
ago and replays the log, so it knows what the fleet spent before this replica first saw the tenant.

The window is `WINDOW_S`, or longer for a tenant whose bucket takes longer to refill (a burst of 10 at one
request a minute refills in 10 minutes: a placement 5 minutes old still holds half of it), as admission
registers it (`keep`); and the last `MIN_KEPT` placements of a tenant are kept whatever their age, so a
replica that meets a slow tenant late still finds them. Memory stays bounded: a tenant's log holds what the
fleet placed within one refill of its slowest bucket (about two of its bursts, the limit holding), or a
window of its traffic, or MIN_KEPT entries, whichever is most.

Written by the router's event loop (`PeerPlacements`), read by the ingress's loop, which may be another
thread: a lock makes each append, trim and read one step. The log is a deque trimmed from the front, each
stale entry popped once (amortised O(1) per placement); `trimmed` counts the entries popped, so a reader's
cursor (a position in everything ever logged for the tenant) stays valid across trims.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import islice

WINDOW_S = 120.0  # two minutes: a prompt-tokens-per-minute bucket refills in one
MIN_KEPT = 256  # a tenant's last placements kept whatever their age (a slow bucket's recent use)


class _Log:
    __slots__ = ("trimmed", "entries")

    def __init__(self) -> None:
        self.trimmed = 0  # entries popped off the front so far
        self.entries: deque[tuple[float, int]] = deque()  # (heard at, prompt tokens), oldest first


class PeerTenantUsage:
    """Per tenant: the peers' requests in flight now, and a log of the ones they placed recently."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._active: dict[str, int] = {}
        self._log: dict[str, _Log] = {}
        self._windows: dict[str, float] = {}  # tenant -> its log's window, where longer than window_s
        self._lock = threading.Lock()

    def keep(self, tenant: str, window_s: float) -> None:
        """Keep `tenant`'s placements at least `window_s` (admission: the refill time of its slowest bucket)."""
        if window_s > self.window(tenant):
            self._windows[tenant] = float(window_s)

    def window(self, tenant: str) -> float:
        """How long `tenant`'s placements are kept."""
        return self._windows.get(tenant, self.window_s)

    def placed(self, tenant: str, prompt_tokens: int) -> None:
        """A peer placed a request of `tenant` (once per request, however often it is routed again)."""
        now = self.clock()
        with self._lock:
            log = self._log.get(tenant)
            if log is None:
                log = self._log[tenant] = _Log()
            entries = log.entries
            entries.append((now, int(prompt_tokens)))
            stale = now - self.window(tenant)
            while len(entries) > MIN_KEPT and entries[0][0] < stale:  # each entry popped once
                entries.popleft()
                log.trimmed += 1

    def in_flight(self, tenant: str, delta: int) -> None:
        """A peer request of `tenant` starts (+1) or stops (-1) being in flight."""
        left = self._active.get(tenant, 0) + delta
        if left > 0:
            self._active[tenant] = left
        else:
            self._active.pop(tenant, None)

    def active(self, tenant: str) -> int:
        """The peers' requests of `tenant` in flight now."""
        return self._active.get(tenant, 0)

    def since(self, tenant: str, cursor: int) -> tuple[int, list[tuple[float, int]]]:
        """The peers' placements of `tenant` after position `cursor` of its log (0: every one kept), oldest
        first, and the cursor to pass next time."""
        with self._lock:
            log = self._log.get(tenant)
            if log is None:
                return max(cursor, 0), []
            entries, trimmed = log.entries, log.trimmed
            start = max(cursor, trimmed)
            end = trimmed + len(entries)
            # one pass from the reader's position (indexing a deque by position walks it: a new reader at the
            # start of a long log would pay about n^2 steps, under the lock the router thread's appends wait on)
            new = list(islice(entries, start - trimmed, None))
            return max(start, end), new

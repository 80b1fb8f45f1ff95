"""What the other ingress replicas placed for each tenant, as this replica's router hears it: the input that
makes a tenant's limits hold across the fleet (`kvmesh.deployments.admission`).

Why a log with times and not totals: a rate limit is a token bucket, which refills over time, so a peer's
request must be taken from this replica's bucket at the time it was placed (as heard), not when this replica
next looks. Charged late, usage from a minute ago would refuse a request now. Each tenant's log keeps the
last `WINDOW_S` of (heard at, prompt tokens); a bucket this replica makes later starts full one window ago
and replays the log, so it knows what the fleet spent before this replica first saw the tenant.

Written by the router's event loop (`PeerPlacements`), read by the ingress's loop, which may be another
thread. Reads are single operations on objects the writer never changes in place except by appending
(a list slice, a dict get), and trimming binds a new list, so a reader never sees a half-done change.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WINDOW_S = 120.0  # two minutes: a prompt-tokens-per-minute bucket refills in one


class PeerTenantUsage:
    """Per tenant: the peers' requests in flight now, and a log of the ones they placed recently."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._active: dict[str, int] = {}
        # tenant -> (how many entries were trimmed off the front so far, [(heard at, prompt tokens), ...])
        self._log: dict[str, tuple[int, list[tuple[float, int]]]] = {}

    def placed(self, tenant: str, prompt_tokens: int) -> None:
        """A peer placed a request of `tenant` (once per request, however often it is routed again)."""
        now = self.clock()
        trimmed, log = self._log.get(tenant, (0, []))
        if not log:
            self._log[tenant] = (trimmed, log)
        log.append((now, int(prompt_tokens)))
        if len(log) >= 64 and log[0][0] < now - self.window_s:  # trim, amortised: a new list, bound at once
            keep = [e for e in log if e[0] >= now - self.window_s]
            self._log[tenant] = (trimmed + len(log) - len(keep), keep)

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
        trimmed, log = self._log.get(tenant, (0, []))
        start = max(cursor, trimmed)
        new = log[start - trimmed :]
        return start + len(new), new

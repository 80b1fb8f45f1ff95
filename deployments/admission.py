"""Per-tenant limits and fair admission for the ingress.

Why: the engines are shared, so without admission one tenant's flood fills every engine queue and
everyone else's TTFT grows with it. Each tenant gets token buckets (requests/s, prompt tokens/min), a
cap on requests in flight (queued here or running), and a prompt-size cap. When a global concurrency
bound is configured, requests beyond it wait in per-tenant queues served round robin, so a tenant with
1000 waiting requests and one with 1 alternate; a wait longer than `queue_timeout_s` becomes a 429.

With several ingress replicas a tenant's limits hold across the fleet: each replica keeps its own
buckets and count, and adds what the other replicas admitted for the same tenant, as their routers'
placement stream tells it (`peers`: `tenant_usage.PeerTenantUsage`): their requests in flight count
against `max_concurrent`, and the requests and prompt tokens they placed are taken from this replica's
buckets at the time they were heard. The stream is milliseconds behind, and within that lag a replica
knows nothing of the others' admissions: a burst that reaches R replicas at once may be admitted up to the
whole limit by each, R x the limit in all (a limit of 3 on 2 replicas: 6), not one request per other
replica. A request is unknown to the peers from its reservation until it is placed (its upload, tokenising
and fair-queue wait), so it is checked again against what they placed meanwhile: `acquire` refuses it when
their requests took the tenant's request bucket below zero (its own token, taken at `reserve`, was then
theirs), and one queued in the fair queue waits on (or times out) while the tenant's fleet-wide
`max_concurrent` is full or the peers took one of its buckets below zero. Without
peers (one ingress replica, or the stream off) the limits are this replica's alone. The global
`max_concurrent` bound stays per replica: it is the capacity of this ingress process.

    reservation = admission.reserve(tenant)                   # before the body is read: slot + 1 request
    try:
        admission.precheck(tenant, 1, exact=False, reservation=reservation)  # optional, before counting
        ticket = await admission.acquire(tenant, prompt_tokens, reservation=reservation)
    finally:
        admission.cancel(reservation)                         # hands it back unless acquire settled it
    try: ...
    finally: admission.release(ticket)

A reservation holds the tenant's concurrency slot and one request-rate token from before the body is read
until `acquire` settles it, so N requests of a tenant arriving together are counted at once: those beyond its
limits are refused before they are read or tokenised, not after.

A tenant's buckets follow its limits: when a reload changes `requests_per_s`, `burst_requests` or
`tokens_per_min`, the buckets are rebuilt at the new size and rate, and what the tenant spent stays spent
(a new bucket holds its new size less what the old one lacked of being full).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.deployments.tenants import KvmeshHTTPError, Limits, Tenant

DEFAULT_QUEUE_TIMEOUT_S = 10.0
CONCURRENCY_RETRY_S = 1.0
# While a queued tenant is at its fleet-wide max_concurrent (its slots taken on other replicas), its waiters
# stay queued and the fair queue looks again this often: a peer's `done` reaches the ingress as no event.
PEER_RECHECK_S = 0.05
FREED_KEPT = 1024  # slot releases remembered for the server_busy Retry-After (the rate they came at)
# The longest Retry-After: one day. A bucket's wait can be longer (a slow rate, or peers' use taking it far
# below zero) or, at a rate near the smallest float, infinite, which `math.ceil` cannot take; a client is
# better told to come back tomorrow than given a 300-digit number or a 500.
MAX_RETRY_AFTER_S = 86_400.0


class AdmissionError(KvmeshHTTPError):
    """A request refused by admission; the ingress returns it as is."""


class RateLimited(AdmissionError):
    """429 with a `Retry-After` (whole seconds, rounded up, at least 1, at most MAX_RETRY_AFTER_S)."""

    status = 429

    def __init__(self, retry_after_s: float, message: str, code: str = "rate_limit_exceeded"):
        super().__init__(message, code)
        retry_after_s = float(retry_after_s)
        # NaN (no wait computable) and inf are capped too: max/min would pass NaN through
        self.retry_after_s = MAX_RETRY_AFTER_S if not retry_after_s <= MAX_RETRY_AFTER_S else max(0.0, retry_after_s)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class PromptTooLarge(AdmissionError):
    """400: this prompt can never be admitted for this tenant, so retrying is pointless."""

    status = 400


class TokenBucket:
    """Classic token bucket: `capacity` tokens, refilled at `rate` per second."""

    __slots__ = ("capacity", "rate", "tokens", "stamp")

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity, self.rate, self.tokens, self.stamp = float(capacity), float(rate), float(capacity), now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until `n` tokens are available (0 if now). Does not take them."""
        self._refill(now)
        return 0.0 if self.tokens >= n else (n - self.tokens) / self.rate

    def take(self, n: float) -> None:
        self.tokens -= n

    def take_at(self, n: float, now: float) -> None:
        """Take `n` spent elsewhere (other ingress replicas), refilled to `now` first; may go below zero."""
        self._refill(now)
        self.tokens -= n

    def give_back(self, n: float) -> None:
        self.tokens = min(self.capacity, self.tokens + n)


@dataclass
class Reservation:
    """A request's place in its tenant's limits before its prompt is counted (its concurrency slot and one
    request-rate token): settled by `acquire`, else handed back by `cancel` (extra cancels are ignored)."""

    tenant_id: str
    serial: int
    settled: bool = False
    took_request: bool = False  # a request-rate token was taken (the tenant had a rate then)


@dataclass
class Ticket:
    """Proof of admission; hand it back to `release` exactly once (extra releases are ignored)."""

    tenant_id: str
    prompt_tokens: int
    serial: int
    released: bool = False


class PeerUsage(Protocol):
    """What the other ingress replicas placed per tenant (`tenant_usage.PeerTenantUsage`)."""

    window_s: float

    # optional: `keep(tenant, window_s)`, to keep a tenant's placements longer than window_s (a slow bucket)

    def active(self, tenant: str) -> int: ...

    def since(self, tenant: str, cursor: int) -> tuple[int, list[tuple[float, int]]]: ...


@dataclass
class _TenantState:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    active: int = 0  # admitted (in flight) + waiting in the fair queue + reserved
    waiters: deque = field(default_factory=deque)
    peers_cursor: int = 0  # how far into the peers' log of this tenant's placements the buckets have taken
    window_s: float = 0.0  # how far back the peers' log is replayed: the longer of its window and a refill
    limits: Limits | None = None  # the tenant's limits as last seen (the fair queue checks max_concurrent)
    queued: int = 0  # waiters still waiting (the deque may hold finished ones until they reach its front)
    reserved: int = 0  # reservations not yet settled (counted in `active` too)


def _burst(lim: Limits) -> float:
    """The requests bucket's size: `burst_requests`, default max(1, requests_per_s)."""
    return (lim.burst_requests or max(1.0, lim.requests_per_s)) if lim.requests_per_s else 0.0


def _bucket_limits(lim: Limits) -> tuple:
    return lim.requests_per_s, _burst(lim), lim.tokens_per_min


def _buckets(lim: Limits, start: float) -> tuple[TokenBucket | None, TokenBucket | None]:
    """A tenant's (requests, prompt tokens) buckets, full at `start`; None where the limit is lifted."""
    req = TokenBucket(_burst(lim), lim.requests_per_s, start) if lim.requests_per_s else None
    tok = TokenBucket(lim.tokens_per_min, lim.tokens_per_min / 60.0, start) if lim.tokens_per_min else None
    return req, tok


class Admission:
    """Admission control for one ingress replica. Not thread-safe: call from the ingress event loop."""

    def __init__(
        self,
        max_concurrent: int | None = None,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        peers: PeerUsage | None = None,
    ):
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1 or None")
        self.max_concurrent = max_concurrent
        self.queue_timeout_s = float(queue_timeout_s)
        self._clock = clock
        self.peers = peers  # the other ingress replicas' usage per tenant (None: this replica's limits alone)
        self._tenants: dict[str, _TenantState] = {}
        self._ready: OrderedDict[str, None] = OrderedDict()  # tenants with waiters, round-robin order
        self._in_flight = 0
        self._serial = itertools.count(1)
        self._freed: deque[float] = deque(maxlen=FREED_KEPT)  # when global slots were released, oldest first
        self._waiting = 0  # waiters still waiting, all tenants
        self._recheck: asyncio.TimerHandle | None = None  # the fair queue's next look at tenants held back

    @classmethod
    def from_registry(cls, registry, **overrides) -> Admission:
        cfg = {**registry.admission_config, **overrides}
        return cls(
            max_concurrent=cfg.get("max_concurrent"),
            queue_timeout_s=cfg.get("queue_timeout_s", DEFAULT_QUEUE_TIMEOUT_S),
        )

    # -- introspection (tests, metrics) --
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def active(self, tenant_id: str) -> int:
        state = self._tenants.get(tenant_id)
        return state.active if state else 0

    def waiting(self, tenant_id: str | None = None) -> int:
        if tenant_id is not None:
            state = self._tenants.get(tenant_id)
            return state.queued if state else 0
        return self._waiting

    # -- admission --
    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._tenants.get(tenant.id)
        lim = tenant.limits
        if state is None:
            # with peers, the buckets start full one window ago, so replaying the peers' log (the fleet's
            # recent use of them) brings them to where a single fleet-wide bucket would be now
            window = self._window(tenant.id, lim)
            start = self._clock() - window
            state = self._tenants[tenant.id] = _TenantState(None, None, window_s=window)
            state.requests, state.tokens = _buckets(lim, start)
        elif state.limits is not None and _bucket_limits(state.limits) != _bucket_limits(lim):
            self._resize(tenant.id, state, lim)
        state.limits = lim
        return state

    def _window(self, tenant_id: str, lim: Limits) -> float:
        """How far back the peers' log is replayed for this tenant: at least the refill time of its slowest
        bucket (a requests bucket of burst 10 at 0.01/s refills in 1000 s). Placements older than that are
        absorbed by any bucket, newer ones are not. 0 without peers."""
        if self.peers is None:
            return 0.0
        window = self.peers.window_s
        if lim.requests_per_s:
            window = max(window, _burst(lim) / lim.requests_per_s)
        if lim.tokens_per_min:
            window = max(window, 60.0)
        keep = getattr(self.peers, "keep", None)
        if keep is not None:
            keep(tenant_id, window)
        return window

    def _resize(self, tenant_id: str, state: _TenantState, lim: Limits) -> None:
        """A reload changed the tenant's rates: new buckets of the new size and rate, less what the old ones
        had spent (spent stays spent; a lifted limit drops its bucket). Kept at their first size, a raised
        `tokens_per_min` refused a prompt above the old size with a 429 forever."""
        now = self._clock()
        requests, tokens = _buckets(lim, now)
        for new, old in ((requests, state.requests), (tokens, state.tokens)):
            if new is not None and old is not None:
                old._refill(now)
                new.tokens = new.capacity - (old.capacity - old.tokens)
        state.requests, state.tokens = requests, tokens
        state.window_s = max(state.window_s, self._window(tenant_id, lim))

    def _peers_active(self, tenant_id: str, state: _TenantState) -> int:
        """The tenant's requests in flight on the other ingress replicas. What they placed since the last
        look is taken from this replica's buckets at the time it was heard (the buckets may go below zero:
        the wait then covers it)."""
        if self.peers is None:
            return 0
        state.peers_cursor, placed = self.peers.since(tenant_id, state.peers_cursor)
        horizon = self._clock() - state.window_s  # the log keeps older entries until it is trimmed
        for at, tokens in placed:
            if at < horizon:  # before a new bucket's start: charged there at its start, it would refill nothing
                continue
            if state.requests is not None:
                state.requests.take_at(1, at)
            if state.tokens is not None:
                state.tokens.take_at(tokens, at)
        return self.peers.active(tenant_id)

    def _check(
        self, tenant: Tenant, prompt_tokens: int, exact: bool = True, reservation: Reservation | None = None
    ) -> _TenantState:
        """Per-tenant checks, charging nothing. `exact=False`: the prompt has at least `prompt_tokens`
        tokens, so the prompt-size checks (whose messages state the count) are left to the real count.
        With a held `reservation` its slot and request token are the request's own: not asked for again."""
        own = 0
        if reservation is not None:
            if reservation.tenant_id != tenant.id or reservation.settled:
                raise ValueError("a reservation counts once, for its own tenant")
            own = 1
        lim: Limits = tenant.limits
        if exact and lim.max_prompt_tokens is not None and prompt_tokens > lim.max_prompt_tokens:
            raise PromptTooLarge(
                f"Prompt has {prompt_tokens} tokens; this API key allows at most {lim.max_prompt_tokens}.",
                "tenant_prompt_limit_exceeded",
            )
        if exact and lim.tokens_per_min is not None and prompt_tokens > lim.tokens_per_min:
            raise PromptTooLarge(
                f"Prompt has {prompt_tokens} tokens, more than this API key's budget of "
                f"{lim.tokens_per_min:g} tokens per minute.",
                "tenant_prompt_limit_exceeded",
            )
        state = self._state(tenant)
        now = self._clock()
        peers_active = self._peers_active(tenant.id, state)
        if lim.max_concurrent is not None and state.active - own + peers_active >= lim.max_concurrent:
            raise RateLimited(
                CONCURRENCY_RETRY_S,
                f"Too many concurrent requests for this API key (limit {lim.max_concurrent}).",
                "concurrency_limit_exceeded",
            )
        # a held reservation took its request token already: it waits only while the peers' requests heard of
        # since have taken the bucket below zero (its token was then theirs: the fleet is over the rate)
        requests_wait = state.requests.wait_s(1 - own, now) if state.requests is not None else 0.0
        tokens_wait = state.tokens.wait_s(prompt_tokens, now) if state.tokens is not None else 0.0
        wait = max(requests_wait, tokens_wait)
        if wait > 0:
            # the bucket named is the one whose wait is the Retry-After
            which = "requests per second" if requests_wait >= tokens_wait else "prompt tokens per minute"
            limited = RateLimited(wait, "")
            retry_s = limited.headers()["Retry-After"]
            raise RateLimited(
                limited.retry_after_s, f"Rate limit reached for this API key ({which}); retry after {retry_s} s."
            )
        return state

    def _check_and_charge(
        self, tenant: Tenant, prompt_tokens: int, reservation: Reservation | None = None
    ) -> _TenantState:
        """Per-tenant checks; on success charges the buckets and counts the request as active. A held
        `reservation` is settled: its slot and request token become the request's. Refused, it is handed
        back (a refused request gets its budget back)."""
        try:
            state = self._check(tenant, prompt_tokens, reservation=reservation)
        except AdmissionError:
            self.cancel(reservation)
            raise
        if reservation is not None:
            reservation.settled = True
            state.reserved -= 1
        else:
            if state.requests is not None:
                state.requests.take(1)
            state.active += 1
        if state.tokens is not None:
            state.tokens.take(prompt_tokens)
        return state

    def reserve(self, tenant: Tenant) -> Reservation:
        """Take the tenant's concurrency slot and one request-rate token now, before the request's body is
        read and its prompt tokenised, or raise what `acquire` would for an empty prompt (never for a full
        server). Why: a check that took nothing let N requests arriving together all pass and all be
        tokenised on the tokenizer every tenant shares, to be refused only once counted. Settle it with
        `acquire(..., reservation=)`; `cancel` hands it back on every other way out."""
        state = self._check(tenant, 0, exact=False)
        if state.requests is not None:
            state.requests.take(1)
        state.active += 1
        state.reserved += 1
        return Reservation(tenant.id, next(self._serial), took_request=state.requests is not None)

    def cancel(self, reservation: Reservation | None) -> None:
        """Hand back a reservation `acquire` did not settle (the request failed or was cancelled first):
        its slot and its request token. Idempotent; a settled reservation is left alone."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        state = self._tenants.get(reservation.tenant_id)
        if state is None:
            return
        state.reserved -= 1
        state.active -= 1
        if reservation.took_request and state.requests is not None:
            state.requests.give_back(1)

    def precheck(
        self, tenant: Tenant, prompt_tokens: int, exact: bool = True, reservation: Reservation | None = None
    ) -> None:
        """Raise now what `acquire` would raise now for this tenant's limits, charging nothing and never
        for a full server (that waits in the fair queue). The ingress calls it before tokenising, so a
        throttled tenant's requests get their 429 without holding the tokenizer from other tenants'.
        `exact=False`: the prompt's count is not known yet, only that it has at least `prompt_tokens`;
        a refusal's Retry-After is then the wait for that many (the real one may be longer). With the
        request's `reservation`, its own slot and request token count as had (the reservation stays held:
        the caller cancels it)."""
        self._check(tenant, int(prompt_tokens), exact, reservation)

    def _undo_charge(self, state: _TenantState, prompt_tokens: int) -> None:
        """A request that was charged but never ran gets its budget back."""
        state.active -= 1
        if state.requests is not None:
            state.requests.give_back(1)
        if state.tokens is not None:
            state.tokens.give_back(prompt_tokens)

    def _ticket(self, tenant: Tenant, prompt_tokens: int) -> Ticket:
        return Ticket(tenant.id, prompt_tokens, next(self._serial))

    def try_acquire(self, tenant: Tenant, prompt_tokens: int) -> Ticket:
        """Admit now or raise; never waits (a full global bound is a 429 here)."""
        state = self._check_and_charge(tenant, int(prompt_tokens))
        self._dispatch()  # the queued go first; a slot it leaves free, no queued request can take now
        if self.max_concurrent is not None and self._in_flight >= self.max_concurrent:
            self._undo_charge(state, int(prompt_tokens))
            raise RateLimited(self._busy_retry_s(), "The server is at capacity; retry shortly.", "server_busy")
        self._in_flight += 1
        return self._ticket(tenant, prompt_tokens)

    async def acquire(self, tenant: Tenant, prompt_tokens: int, reservation: Reservation | None = None) -> Ticket:
        """Admit, waiting in the tenant's fair queue (up to queue_timeout_s) when the server is full. With
        the request's `reservation` (`reserve`), the prompt's tokens are charged against it; refused, timed
        out or cancelled, the reservation's budget comes back with the rest."""
        prompt_tokens = int(prompt_tokens)
        state = self._check_and_charge(tenant, prompt_tokens, reservation)
        if self.max_concurrent is not None:
            self._dispatch()  # the queued go first; a slot it leaves free, no queued request can take now
        if self.max_concurrent is None or self._in_flight < self.max_concurrent:
            self._in_flight += 1
            return self._ticket(tenant, prompt_tokens)
        waiter = asyncio.get_running_loop().create_future()
        state.waiters.append(waiter)
        state.queued += 1
        self._waiting += 1
        self._ready.setdefault(tenant.id, None)
        try:
            await asyncio.wait({waiter}, timeout=self.queue_timeout_s)
        except asyncio.CancelledError:  # the client went away while queued
            if waiter.done() and not waiter.cancelled():
                self._in_flight -= 1  # the slot was granted to us: pass it on
                self._forget_waiter(tenant.id, state, waiter, granted=True)
                self._dispatch()
            else:
                self._forget_waiter(tenant.id, state, waiter, granted=False)
            self._undo_charge(state, prompt_tokens)
            raise
        if waiter.done() and not waiter.cancelled():
            return self._ticket(tenant, prompt_tokens)  # _dispatch already counted the slot
        self._forget_waiter(tenant.id, state, waiter, granted=False)
        self._undo_charge(state, prompt_tokens)
        raise RateLimited(
            self._busy_retry_s(),
            f"The server is at capacity (waited {self.queue_timeout_s:g} s); retry shortly.",
            "server_busy",
        )

    def _busy_retry_s(self) -> float:
        """Retry-After of a `server_busy`: how long the requests queued now, and one more, take to get a slot
        at the rate slots were released over the last queue_timeout_s, between 1 s and queue_timeout_s
        (queue_timeout_s when none was released in that time: a retry sooner would find the same queue).
        A fixed 1 s sent a client that had just waited the whole timeout straight back into a full queue."""
        now = self._clock()
        while self._freed and self._freed[0] < now - self.queue_timeout_s:
            self._freed.popleft()
        if not self._freed:
            return max(CONCURRENCY_RETRY_S, self.queue_timeout_s)
        # more releases than are kept: their rate over the time the kept ones span
        span = self.queue_timeout_s if len(self._freed) < FREED_KEPT else now - self._freed[0]
        if span <= 0:
            return CONCURRENCY_RETRY_S
        drain_s = (self.waiting() + 1) * span / len(self._freed)
        return max(CONCURRENCY_RETRY_S, min(self.queue_timeout_s, drain_s))

    def _forget_waiter(self, tenant_id: str, state: _TenantState, waiter: asyncio.Future, granted: bool) -> None:
        """A waiter stops waiting (timed out, cancelled; `granted`: it had its slot, `_dispatch` counted it).
        O(1) amortised: finished waiters are dropped when they reach the deque's front (each once), or all
        at once when the tenant has none waiting left, which also takes it out of the round robin. Rebuilding
        the deque here made a flood of N queued requests timing out O(N^2)."""
        if not granted and not waiter.done():
            state.queued -= 1
            self._waiting -= 1
        waiter.cancel()
        waiters = state.waiters
        while waiters and waiters[0].done():
            waiters.popleft()
        if state.queued <= 0:
            waiters.clear()
            self._ready.pop(tenant_id, None)

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        state = self._tenants.get(ticket.tenant_id)
        if state is not None:
            state.active -= 1
        self._in_flight -= 1
        if self.max_concurrent is not None:
            self._freed.append(self._clock())
        self._dispatch()

    def _at_fleet_limit(self, tenant_id: str, state: _TenantState) -> bool:
        """Whether the tenant's requests running here and on the peers fill its max_concurrent, or the peers'
        requests took one of its buckets below zero. Its queued requests were admitted against both here
        (their request and prompt tokens taken), but the peers do not know of them until they run, so they
        may have spent the fleet's budget meanwhile: then a queued request waits on (or times out) rather
        than pass it, until a slot frees or the bucket refills to zero."""
        lim = state.limits
        if lim is None or self.peers is None:
            return False
        peers_active = self._peers_active(tenant_id, state)  # charges what the peers placed since the last look
        now = self._clock()
        if any(bucket is not None and bucket.wait_s(0, now) > 0 for bucket in (state.requests, state.tokens)):
            return True
        if lim.max_concurrent is None:
            return False
        running = state.active - state.queued - state.reserved  # active counts queued and reserved too
        return running + peers_active >= lim.max_concurrent

    def _dispatch(self) -> None:
        """Grant free global slots to waiting tenants, one per tenant per round (round robin). A tenant at
        its fleet-wide max_concurrent is passed over (its waiters stay queued, in their turn for the next
        look, at the next release or after PEER_RECHECK_S), so it holds up neither slots nor other tenants."""
        held_back: list[str] = []
        while self._ready and (self.max_concurrent is None or self._in_flight < self.max_concurrent):
            tenant_id, _ = self._ready.popitem(last=False)
            state = self._tenants[tenant_id]
            waiters = state.waiters
            while waiters and waiters[0].done():  # drop timed-out / cancelled waiters
                waiters.popleft()
            if not waiters:
                continue
            if self._at_fleet_limit(tenant_id, state):
                held_back.append(tenant_id)
                continue
            waiters.popleft().set_result(True)
            state.queued -= 1
            self._waiting -= 1
            self._in_flight += 1
            while waiters and waiters[0].done():
                waiters.popleft()
            if waiters:
                self._ready[tenant_id] = None  # back of the line
        for tenant_id in reversed(held_back):  # first in line again, in their order
            self._ready[tenant_id] = None
            self._ready.move_to_end(tenant_id, last=False)
        if held_back and self._recheck is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # released outside the loop: the next release or acquire looks again
                return
            self._recheck = loop.call_later(PEER_RECHECK_S, self._look_again)

    def _look_again(self) -> None:
        self._recheck = None
        self._dispatch()

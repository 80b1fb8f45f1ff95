"""A tenant's limits hold across ingress replicas: each replica's admission adds what the others placed for
the tenant, as their routers' placement stream reports it (`PeerPlacements.tenants`); without the
stream each replica enforces the limits alone, so R replicas admit up to R x a limit (docs/scale.md)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.deployments.admission import MAX_RETRY_AFTER_S, Admission, RateLimited
from kvmesh.deployments.router_sync import PeerPlacements, routed_message
from kvmesh.deployments.tenant_usage import MIN_KEPT, PeerTenantUsage
from kvmesh.deployments.tenants import Limits, Tenant
from kvmesh.policies.base import RequestInfo


class Index:
    """The index calls peer placements make (kvmesh's own interface)."""

    def replicas(self):
        return ["e0"]

    def speculate(self, replica, hashes, fresh):
        pass

    def withdraw(self, replica, fresh):
        pass


def _tenant(tenant_id: str = "acme", **limits) -> Tenant:
    return Tenant(id=tenant_id, group=None, salt="s" * 64, limits=Limits(**limits))


class Fleet:
    """R ingress replicas, each an `Admission` fed by its own `PeerPlacements`; a replica that admits a
    request routes it, and its router's `routed` message (and later `done`) reaches every other replica,
    as the placement stream delivers it (here at once)."""

    def __init__(self, replicas: int, synced: bool = True, clock=None):
        clock = clock or (lambda: 0.0)
        self.peers = [PeerPlacements(Index(), lambda: [], tenants=PeerTenantUsage(clock)) for _ in range(replicas)]
        self.fronts = [Admission(clock=clock, peers=p.tenants if synced else None) for p in self.peers]
        self.serial = 0

    def send(self, k: int, tenant: Tenant, prompt_tokens: int = 10):
        """Request to replica k: its ticket and the request id, or None when refused."""
        try:
            ticket = self.fronts[k].try_acquire(tenant, prompt_tokens)
        except RateLimited:
            return None
        self.serial += 1
        rid = f"q{self.serial}"
        info = RequestInfo([1, 2], prompt_tokens, 32, tenant=tenant.id, request_id=rid)
        self._publish(k, routed_message(f"router{k}", info, "e0", (0, 0, 0)))
        return ticket, rid

    def finish(self, k: int, sent) -> None:
        ticket, rid = sent
        self.fronts[k].release(ticket)
        self._publish(k, ["done", f"router{k}", rid, "e0"])

    def _publish(self, k: int, msg: list) -> None:
        for j, peers in enumerate(self.peers):
            if j != k:
                peers.apply(msg)


@pytest.mark.parametrize("ingress_replicas", [1, 2, 4])
def test_a_concurrency_limit_holds_across_ingress_replicas(ingress_replicas):
    tenant = _tenant(max_concurrent=3)
    fleet = Fleet(ingress_replicas)
    # a front that spreads connections evenly: requests go to the replicas in turn
    sent = [(k, fleet.send(k, tenant)) for _ in range(5) for k in range(ingress_replicas)]
    admitted = [(k, s) for k, s in sent if s]
    assert len(admitted) == 3  # 3 in all, wherever they landed
    assert all(fleet.send(k, tenant) is None for k in range(ingress_replicas))
    k, first = admitted[0]
    fleet.finish(k, first)  # one ends on its replica: any replica may admit one more, and only one
    other = (k + 1) % ingress_replicas
    assert fleet.send(other, tenant) is not None
    assert all(fleet.send(j, tenant) is None for j in range(ingress_replicas))


def test_another_tenants_requests_do_not_count():
    fleet = Fleet(2)
    busy, calm = _tenant("busy", max_concurrent=2), _tenant("calm", max_concurrent=2)
    assert fleet.send(0, busy) and fleet.send(1, busy)
    assert fleet.send(0, busy) is None and fleet.send(1, busy) is None
    assert fleet.send(0, calm) and fleet.send(1, calm)


@pytest.mark.parametrize("ingress_replicas", [1, 3])
def test_a_request_rate_limit_holds_across_ingress_replicas(ingress_replicas):
    now = [0.0]
    tenant = _tenant(requests_per_s=2, burst_requests=2)
    fleet = Fleet(ingress_replicas, clock=lambda: now[0])
    admitted = sum(1 for _ in range(10) for k in range(ingress_replicas) if fleet.send(k, tenant))
    assert admitted == 2
    now[0] = 1.0  # a second later the fleet's bucket has refilled by the rate: 2 more in all
    admitted = sum(1 for _ in range(10) for k in range(ingress_replicas) if fleet.send(k, tenant))
    assert admitted == 2


def test_a_prompt_token_budget_holds_across_ingress_replicas():
    now = [0.0]
    tenant = _tenant(tokens_per_min=1000)
    fleet = Fleet(2, clock=lambda: now[0])
    assert fleet.send(0, tenant, 600)
    with pytest.raises(RateLimited) as refused:  # 600 spent on replica 0 leave 400 here too
        fleet.fronts[1].try_acquire(tenant, 600)
    assert 10 < refused.value.retry_after_s <= 12.5  # 200 tokens more at 1000 per minute
    assert fleet.send(1, tenant, 400)


def test_a_replica_that_meets_a_tenant_late_knows_what_the_fleet_spent_recently():
    now = [0.0]
    tenant = _tenant(requests_per_s=1, burst_requests=2)
    fleet = Fleet(2, clock=lambda: now[0])
    assert fleet.send(0, tenant) and fleet.send(0, tenant)
    now[0] = 0.5  # replica 1 sees the tenant for the first time: the fleet's bucket is nearly empty
    assert fleet.send(1, tenant) is None
    now[0] = 100.0  # long after: everyone's bucket is full again, whatever the peers spent back then
    assert fleet.send(1, tenant) and fleet.send(1, tenant)
    assert fleet.send(1, tenant) is None


def test_a_replica_that_meets_a_tenant_late_does_not_charge_what_the_fleet_spent_before_the_window():
    """The peers' usage log keeps entries older than its window until it is trimmed: replayed into a new
    bucket (which starts one window ago), an hour of light use would be charged at once."""
    now = [0.0]
    tenant = _tenant(requests_per_s=0.1, tokens_per_min=60_000)
    fleet = Fleet(2, clock=lambda: now[0])
    for minute in range(60):  # one 2000-token request a minute through replica 0: a tenth of its limits
        now[0] = minute * 60.0
        assert fleet.send(0, tenant, prompt_tokens=2000)
    now[0] = 3600.0 + 30  # replica 1 meets the tenant; a fleet-wide bucket is full again
    assert fleet.send(1, tenant, prompt_tokens=2000)


def test_peers_usage_is_charged_when_it_was_heard_not_when_this_replica_looks():
    now = [0.0]
    tenant = _tenant(requests_per_s=1, burst_requests=3)
    fleet = Fleet(2, clock=lambda: now[0])
    assert fleet.send(1, tenant)  # replica 1 has the tenant's bucket (3, one taken)
    assert fleet.send(0, tenant) and fleet.send(0, tenant)  # the peer takes 2 at t=0: 0 left fleet-wide
    now[0] = 50.0  # replica 1 looks only now: refilled since, so it admits up to the burst again
    assert sum(1 for _ in range(5) if fleet.send(1, tenant)) == 3


@pytest.mark.parametrize("ingress_replicas", [1, 2, 4])
def test_without_the_placement_stream_each_replica_enforces_the_limit_alone(ingress_replicas):
    tenant = _tenant(max_concurrent=3)
    fleet = Fleet(ingress_replicas, synced=False)
    admitted = sum(1 for k in range(ingress_replicas) for _ in range(5) if fleet.send(k, tenant))
    assert admitted == 3 * ingress_replicas


def test_peer_placements_count_a_tenants_requests_in_flight_and_placed():
    now = [5.0]
    peers = PeerPlacements(Index(), lambda: [], tenants=PeerTenantUsage(lambda: now[0]))
    usage = peers.tenants
    info = RequestInfo([1, 2], 70, 32, tenant="acme", request_id="q1")
    peers.apply(routed_message("a", info, "e0", (0, 0, 0)))
    assert usage.active("acme") == 1 and usage.since("acme", 0) == (1, [(5.0, 70)])
    peers.apply(["unrouted", "a", "q1", "e0"])
    now[0] = 6.0
    peers.apply(routed_message("a", info, "e0", (0, 0, 0)))  # moved: still one request
    assert usage.active("acme") == 1 and usage.since("acme", 0) == (1, [(5.0, 70)])
    peers.apply(["done", "a", "q1", "e0"])
    assert usage.active("acme") == 0
    peers.apply(routed_message("b", RequestInfo([3], 40, 32, tenant="acme", request_id="q1"), "e0", (0, 0, 0)))
    assert usage.active("acme") == 1 and usage.since("acme", 1) == (2, [(6.0, 40)])
    peers.apply(["bye", "b", "", ""])  # a peer that leaves takes its requests in flight with it
    assert usage.active("acme") == 0
    assert usage.active("other") == 0 and usage.since("other", 0) == (0, [])


def test_the_usage_log_keeps_one_window_and_cursors_survive_its_trimming():
    now = [0.0]
    usage = PeerTenantUsage(lambda: now[0], window_s=10.0)
    n = MIN_KEPT * 4
    for t in range(n):
        now[0] = t / 10  # 10 a second: a window is 100 placements, fewer than MIN_KEPT
        usage.placed("acme", t)
    cursor, seen = usage.since("acme", n - 5)
    assert cursor == n and [tokens for _, tokens in seen] == list(range(n - 5, n))
    cursor, seen = usage.since("acme", 0)  # a cursor from before the trim: what is kept, in order
    assert cursor == n and [tokens for _, tokens in seen] == list(range(n - MIN_KEPT, n))  # trimmed as it grew
    usage.keep("acme", 60.0)  # a slow bucket's tenant: 60 s, 600 placements
    for t in range(n, 2 * n):
        now[0] = t / 10
        usage.placed("acme", t)
    cursor, seen = usage.since("acme", 0)
    assert cursor == 2 * n and len(seen) in (600, 601) and seen[-1][1] == 2 * n - 1
    assert usage.since("acme", cursor) == (cursor, [])


def test_the_usage_log_trims_to_its_window_and_a_cursor_reads_on_after_a_trim():
    """Stale placements leave the log's front one at a time (the trim once copied the whole log on almost every
    placement; its cost is not timed here), and a reader's cursor stays valid across trims."""
    now = [0.0]
    usage = PeerTenantUsage(lambda: now[0], window_s=10.0)
    for t in range(20_000):
        now[0] = t / 1000  # 1000 a second: a window holds 10,000
        usage.placed("acme", 1)
    cursor, seen = usage.since("acme", 0)
    for t in range(20_000, 40_000):
        now[0] = t / 1000
        usage.placed("acme", 1)
    after, more = usage.since("acme", cursor)
    # the cursor moves past every placement since it; those still in the window come back, each once
    assert after == cursor + 20_000 and len(more) == len({at for at, _ in more}) == 10_000
    oldest = usage.since("acme", 0)[1][0][0]
    assert now[0] - 10.0 - 0.01 <= oldest <= now[0] - 10.0 + 0.01  # trimmed to the window, no further


def test_a_slow_bucket_counts_what_peers_placed_longer_ago_than_the_default_window():
    """A requests bucket that refills in more than WINDOW_S (1 request in 200 s) still holds a peer's request
    of 125 s ago; with a fixed 120 s window the replica that met the tenant then admitted a second one."""
    now = [0.0]
    tenant = _tenant(requests_per_s=0.005)
    fleet = Fleet(2, clock=lambda: now[0])
    assert fleet.send(0, tenant)
    now[0] = 125.0
    assert fleet.send(1, tenant) is None
    now[0] = 200.0
    assert fleet.send(1, tenant)


def test_a_slow_large_burst_is_not_spent_twice_across_replicas():
    now = [0.0]
    tenant = _tenant(requests_per_s=0.01, burst_requests=10)
    fleet = Fleet(2, clock=lambda: now[0])
    assert fleet.send(1, tenant)
    now[0] = 1.0
    assert sum(1 for _ in range(12) if fleet.send(0, tenant)) == 9
    now[0] = 130.0  # a fleet bucket holds 1.29 now
    assert sum(1 for _ in range(10) if fleet.send(1, tenant)) == 1


def test_the_check_before_tokenising_counts_what_other_replicas_spent_once_and_charges_nothing():
    now = [0.0]
    tenant = _tenant(requests_per_s=1, burst_requests=2)
    fleet = Fleet(2, clock=lambda: now[0])
    assert fleet.send(0, tenant) and fleet.send(0, tenant)  # replica 0 spends the fleet's burst
    with pytest.raises(RateLimited) as early:
        fleet.fronts[1].precheck(tenant, 1, exact=False)
    with pytest.raises(RateLimited) as counted:
        fleet.fronts[1].try_acquire(tenant, 10)
    assert early.value.body() == counted.value.body() and early.value.headers() == counted.value.headers()
    now[0] = 1.0  # one request back fleet-wide
    for _ in range(3):
        fleet.fronts[1].precheck(tenant, 10)
    assert fleet.send(1, tenant) and fleet.send(1, tenant) is None


@pytest.mark.parametrize("rate", [1e-310, 1e-300, 1e-9])
def test_a_tiny_rate_that_bypasses_the_config_check_is_a_429_of_at_most_a_day(rate):
    """1/1e-310 is inf: math.ceil raised OverflowError (a 500); 1e-300 gave a 301-digit Retry-After."""
    adm = Admission(clock=lambda: 0.0)
    tenant = _tenant(requests_per_s=rate)  # Limits made directly: config validation refuses these
    adm.try_acquire(tenant, 10)  # the burst of 1
    for check in (lambda: adm.precheck(tenant, 0, exact=False), lambda: adm.try_acquire(tenant, 10)):
        with pytest.raises(RateLimited) as refused:
            check()
        assert refused.value.retry_after_s == MAX_RETRY_AFTER_S
        assert refused.value.headers() == {"Retry-After": "86400"} and "86400 s" in refused.value.message


def test_a_flood_of_waiters_timing_out_leaves_nothing_queued_or_counted():
    """Each timed-out waiter once rebuilt its tenant's deque (and `waiting()` scanned it), O(N^2) for a flood;
    now counted as they go (cost not timed here): the counts and the round robin end empty."""

    async def flood(n):
        adm = Admission(max_concurrent=1, queue_timeout_s=0.05)
        tenant = _tenant("flood")
        held = await adm.acquire(tenant, 1)

        async def one():
            with pytest.raises(RateLimited):
                await adm.acquire(tenant, 1)

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.sleep(0)
        assert adm.waiting("flood") == n and adm.waiting() == n
        await asyncio.gather(*tasks)
        assert adm.waiting() == 0 and adm.active("flood") == 1 and not adm._ready
        assert not adm._tenants["flood"].waiters
        adm.release(held)
        assert adm.active("flood") == 0

    asyncio.run(flood(4000))


def test_a_queued_request_does_not_pass_its_tenants_limit_taken_meanwhile_on_another_replica():
    """Replica 0's global bound is full, so tenant x's 2 requests (limit 2) wait in its fair queue, unknown
    to replica 1, which admits 2 of x meanwhile; when replica 0's slots free, its queued x requests stay
    queued (4 ran at once before), and run once replica 1's end."""

    async def scenario():
        fleet = Fleet(2)
        zero, one = fleet.fronts
        zero.max_concurrent = 2
        x, y = _tenant("x", max_concurrent=2), _tenant("y")
        busy = [await zero.acquire(y, 10) for _ in range(2)]
        queued = [asyncio.create_task(zero.acquire(x, 10)) for _ in range(2)]
        await asyncio.sleep(0)
        assert zero.waiting("x") == 2
        elsewhere = [fleet.send(1, x), fleet.send(1, x)]
        assert all(elsewhere)
        other = asyncio.create_task(zero.acquire(_tenant("z"), 10))  # queued behind x's: not starved by them
        await asyncio.sleep(0)
        for ticket in busy:
            zero.release(ticket)
        await asyncio.sleep(0)
        assert not any(t.done() for t in queued) and zero.waiting("x") == 2
        z_ticket = await asyncio.wait_for(other, 1.0)
        assert zero.in_flight == 1  # z ran; the slot x cannot use now stays free
        zero.release(zero.try_acquire(y, 10))  # and a new request of another tenant may take it
        zero.release(z_ticket)
        for sent in elsewhere:
            fleet.finish(1, sent)
        tickets = await asyncio.wait_for(asyncio.gather(*queued), 1.0)  # the next look finds room
        assert len(tickets) == 2 and zero.waiting() == 0
        return zero

    asyncio.run(scenario())


def test_a_queued_request_held_back_by_its_fleet_limit_still_times_out():
    async def scenario():
        fleet = Fleet(2)
        zero = fleet.fronts[0]
        zero.max_concurrent, zero.queue_timeout_s = 1, 0.2
        x = _tenant("x", max_concurrent=1)
        busy = await zero.acquire(_tenant("y"), 10)
        queued = asyncio.create_task(zero.acquire(x, 10))
        await asyncio.sleep(0)
        assert fleet.send(1, x)
        zero.release(busy)
        with pytest.raises(RateLimited) as refused:
            await asyncio.wait_for(queued, 1.0)
        assert refused.value.code == "server_busy"
        assert zero.waiting() == 0 and zero.active("x") == 0 and zero.in_flight == 0 and not zero._ready

    asyncio.run(scenario())


def test_a_request_reserved_before_the_peers_spent_the_rate_is_refused_when_it_is_admitted():
    """Replica 0 reserves a request (its body still uploading) and takes the tenant's one request token; replica
    1, knowing nothing of it, admits one, which replica 0 hears. Replica 0's bucket is then below zero: its
    request's token went to replica 1's, so `acquire` refuses it (its token back) with a Retry-After of the
    refill. Neither acquire nor the fair queue looked at the request bucket again: both ran, 2 in 10 s."""
    now = [0.0]
    tenant = _tenant(requests_per_s=0.1, burst_requests=1)
    fleet = Fleet(2, clock=lambda: now[0])
    zero = fleet.fronts[0]
    reservation = zero.reserve(tenant)
    now[0] = 0.5
    assert fleet.send(1, tenant)
    now[0] = 3.0
    with pytest.raises(RateLimited) as refused:
        asyncio.run(zero.acquire(tenant, 10, reservation=reservation))
    assert refused.value.code == "rate_limit_exceeded" and refused.value.retry_after_s == pytest.approx(7.0)
    assert zero.active("acme") == 0 and zero._tenants["acme"].requests.tokens == pytest.approx(0.3)
    now[0] = 10.0  # refilled to one request: the fleet's next one passes here
    assert fleet.send(0, tenant)


def test_a_request_whose_own_token_emptied_the_bucket_is_admitted():
    """Only the peers' use can refuse a held reservation: its own token, taking the bucket to 0 (or the peers'
    taking it to just 0 with it), is the request's to use."""
    now = [0.0]
    tenant = _tenant(requests_per_s=1, burst_requests=2)
    fleet = Fleet(2, clock=lambda: now[0])
    zero = fleet.fronts[0]
    reservation = zero.reserve(tenant)  # 2 -> 1
    assert fleet.send(1, tenant)  # heard here: 1 -> 0, with this request's token the fleet's 2
    ticket = asyncio.run(zero.acquire(tenant, 10, reservation=reservation))
    assert zero._tenants["acme"].requests.tokens == pytest.approx(0.0)
    zero.release(ticket)
    alone = Admission(clock=lambda: 0.0)
    alone.release(asyncio.run(alone.acquire(tenant, 10, reservation=alone.reserve(tenant))))
    alone.release(asyncio.run(alone.acquire(tenant, 10, reservation=alone.reserve(tenant))))  # 1 -> 0: its own


@pytest.mark.parametrize("bucket", ["requests_per_s", "tokens_per_min"])
def test_a_queued_request_waits_while_the_peers_spent_its_tenants_rate_meanwhile(bucket):
    """Replica 0's global bound is full: x's request, admitted (its tokens taken), waits in the fair queue,
    unknown to replica 1, which spends x's whole budget meanwhile. When a slot frees, the request waits on
    while the peers have the bucket below zero, and runs once it has refilled to zero."""
    limits = {"requests_per_s": {"requests_per_s": 1, "burst_requests": 1}, "tokens_per_min": {"tokens_per_min": 60}}

    async def scenario():
        now = [0.0]
        fleet = Fleet(2, clock=lambda: now[0])
        zero = fleet.fronts[0]
        zero.max_concurrent = 1
        x = _tenant("x", **limits[bucket])
        busy = await zero.acquire(_tenant("y"), 10)
        queued = asyncio.create_task(zero.acquire(x, 10 if bucket == "requests_per_s" else 60))
        await asyncio.sleep(0)
        assert zero.waiting("x") == 1
        assert fleet.send(1, x, 10 if bucket == "requests_per_s" else 60)
        zero.release(busy)
        await asyncio.sleep(0.15)  # looked at again every PEER_RECHECK_S
        assert not queued.done() and zero.waiting("x") == 1 and zero.in_flight == 0
        now[0] = 1.0 if bucket == "requests_per_s" else 60.0  # refilled: the peers' request is paid for, and
        # this one's tokens were taken before
        return await asyncio.wait_for(queued, 1.0)

    assert asyncio.run(scenario())


# --- reservations: a request counts from before its body is read -----------------------------------------


def test_forty_reservations_at_once_for_a_tenant_limited_to_one_let_exactly_one_through():
    """A check that took nothing let all 40 pass and be tokenised, to be refused only once counted."""
    adm = Admission(clock=lambda: 0.0)
    tenant = _tenant(requests_per_s=1, burst_requests=1, max_concurrent=1)
    held, refused = [], []
    for _ in range(40):
        try:
            held.append(adm.reserve(tenant))
        except RateLimited as exc:
            refused.append(exc)
    assert len(held) == 1 and len(refused) == 39 and adm.active("acme") == 1
    assert {exc.code for exc in refused} == {"concurrency_limit_exceeded"}

    async def settle():
        return await adm.acquire(tenant, 10, reservation=held[0])

    ticket = asyncio.run(settle())
    assert adm.active("acme") == 1 and adm._tenants["acme"].reserved == 0
    adm.release(ticket)
    assert adm.active("acme") == 0
    with pytest.raises(RateLimited) as rate:  # its one request token was spent: the rate refuses now
        adm.reserve(tenant)
    assert rate.value.code == "rate_limit_exceeded" and adm.active("acme") == 0


@pytest.mark.parametrize("seed", range(4))
def test_a_reservation_comes_back_on_every_way_a_request_can_fail(seed):
    """Reservation, then each failure path at random (refused before counting, refused once counted, cancelled
    before acquire, timed out or cancelled in the fair queue, answered): nothing stays counted, and the budget
    of every request that did not run comes back."""
    import random

    from kvmesh.deployments.admission import PromptTooLarge

    rng = random.Random(seed)

    async def run():
        adm = Admission(max_concurrent=1, queue_timeout_s=0.01, clock=lambda: 0.0)  # time stands still
        tenant = _tenant(requests_per_s=1, burst_requests=1000, tokens_per_min=100, max_concurrent=2)
        blocker = _tenant("other")
        answered = 0
        for _ in range(120):
            path = rng.choice(["cancel", "precheck", "too_large", "over_budget", "timeout", "queued_cancel", "ok"])
            r = adm.reserve(tenant)
            assert adm.active("acme") == 1
            if path == "cancel":  # a bad body, a tokenizer error, the client gone before acquire
                adm.cancel(r)
            elif path == "precheck":  # more than the tokens left, before tokenising
                with pytest.raises(RateLimited):
                    adm.precheck(tenant, 101 + rng.randrange(50), exact=False, reservation=r)
                adm.cancel(r)
            elif path == "too_large":
                with pytest.raises(PromptTooLarge):
                    await adm.acquire(tenant, 101 + rng.randrange(50), reservation=r)
            elif path == "over_budget":
                with adm_spent(adm, tenant):
                    with pytest.raises(RateLimited):
                        await adm.acquire(tenant, 10, reservation=r)
            elif path in ("timeout", "queued_cancel"):
                busy = await adm.acquire(blocker, 1)  # the server is full: the request queues
                task = asyncio.create_task(adm.acquire(tenant, 1, reservation=r))
                await asyncio.sleep(0)
                assert adm.waiting("acme") == 1
                if path == "queued_cancel":
                    task.cancel()
                with pytest.raises((RateLimited, asyncio.CancelledError)):
                    await task
                adm.release(busy)
            else:
                adm.release(await adm.acquire(tenant, 0, reservation=r))
                answered += 1
            adm.cancel(r)  # what the ingress does on its way out, whatever happened: a no-op now
            state = adm._tenants["acme"]
            assert (adm.active("acme"), state.reserved, adm.in_flight, adm.waiting()) == (0, 0, 0, 0), path
            assert state.requests.tokens == 1000 - answered and state.tokens.tokens == 100
        assert answered

    asyncio.run(run())


class adm_spent:
    """The tenant's prompt-token bucket emptied for the block, refilled after (a budget spent elsewhere)."""

    def __init__(self, adm: Admission, tenant: Tenant):
        self.bucket = adm._tenants[tenant.id].tokens

    def __enter__(self):
        self.saved, self.bucket.tokens = self.bucket.tokens, 0.0

    def __exit__(self, *exc):
        self.bucket.tokens = self.saved


# --- a reload that changes a tenant's rates resizes its buckets -------------------------------------------


def test_a_raised_or_lifted_token_budget_admits_a_prompt_above_the_old_one():
    """Buckets kept at the size they had at a tenant's first request refused a prompt within the new budget
    but above the old one with a 429 forever."""

    async def run():
        now = [0.0]
        for new in (10000, None):
            adm = Admission(clock=lambda: now[0])
            adm.release(await adm.acquire(_tenant(tokens_per_min=1000), 10))
            now[0] += 6.0
            adm.release(await adm.acquire(_tenant(tokens_per_min=new), 5000))
            bucket = adm._tenants["acme"].tokens
            assert (bucket is None) if new is None else (bucket.capacity == new)

    asyncio.run(run())


def test_a_resized_bucket_keeps_what_was_spent():
    """Spent stays spent: lowered from 10000 to 1000 tokens a minute after 5000 were spent, the bucket owes
    4000, so a 500-token prompt waits for 4500 tokens at the new rate (270 s); a burst raised from 1 to 5
    after 1 request leaves 4."""
    from kvmesh.deployments.admission import PromptTooLarge

    async def run():
        now = [0.0]
        adm = Admission(clock=lambda: now[0])
        adm.release(await adm.acquire(_tenant(tokens_per_min=10000), 5000))
        with pytest.raises(RateLimited) as refused:
            await adm.acquire(_tenant(tokens_per_min=1000), 500)
        assert refused.value.headers() == {"Retry-After": "270"}
        with pytest.raises(PromptTooLarge):  # above the bucket's new size: the 400, never admissible
            adm.precheck(_tenant(tokens_per_min=1000), 1001)
        now[0] += 270.0
        adm.release(await adm.acquire(_tenant(tokens_per_min=1000), 500))

        adm = Admission(clock=lambda: now[0])
        adm.release(await adm.acquire(_tenant(requests_per_s=0.001, burst_requests=1), 1))
        more = _tenant(requests_per_s=0.001, burst_requests=5)
        for _ in range(4):
            adm.release(await adm.acquire(more, 1))
        with pytest.raises(RateLimited):
            await adm.acquire(more, 1)

    asyncio.run(run())


def test_a_tenants_file_reload_that_raises_the_token_budget_takes_effect(tmp_path, monkeypatch):
    import hashlib

    from kvmesh.deployments.tenants import TenantRegistry

    monkeypatch.delenv("KVMESH_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE", raising=False)
    key = "kvm-" + "a" * 40
    (tmp_path / "secret").write_text("s" * 64)
    path = tmp_path / "tenants.yaml"

    digest = hashlib.sha256(key.encode()).hexdigest()

    def write(tokens_per_min: str) -> None:
        path.write_text(
            f"secret_file: secret\ntenants:\n  - id: acme\n    keys: [{{sha256: {digest}}}]\n"
            f"    limits: {{tokens_per_min: {tokens_per_min}}}\n"
        )

    async def run():
        now = [0.0]
        write("1000")
        registry = TenantRegistry.from_file(path, reload_interval_s=5, clock=lambda: now[0])
        adm = Admission(clock=lambda: now[0])
        adm.release(await adm.acquire(registry.authenticate("Bearer " + key), 10))
        write("10000")
        now[0] += 6.0
        tenant = registry.authenticate("Bearer " + key)
        assert tenant.limits.tokens_per_min == 10000
        adm.release(await adm.acquire(tenant, 5000))

    asyncio.run(run())

"""Suspect replicas (deployments/replica_watch.py): a replica that stops answering Serve's queue-length probe
(its node froze, or was cut off) is left out of the ranking until it answers again, and nothing the router
keeps about it is forgotten meanwhile (fake replicas whose probe hangs or answers, no Ray)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from router_fakes import fake_request, make_router
from router_fakes import ranked_ids as _ids

from kvmesh.deployments import local_state
from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.replica_loss import OpenCalls

FAST = {"probe_interval_s": 0.02, "probe_deadline_s": 0.05}  # the router's probe, sped up for tests


@dataclasses.dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


class Replica:
    """A running replica as the router sees it, with Serve's queue-length call: it answers, hangs (`frozen`)
    or raises (`fail`)."""

    def __init__(self, rid: str, node: str = "n0"):
        self.replica_id = _ReplicaID(rid)
        self.routing_stats = {"node_id": node}
        self.node_id = node
        self.max_ongoing_requests = 64
        self.frozen = False
        self.fail: BaseException | None = None
        self.probes = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        if self.fail is not None:
            raise self.fail
        while self.frozen:
            await asyncio.sleep(0.005)
        return 0


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch):
    monkeypatch.setattr(local_state, "LEDGER", PredictionLedger())


async def _until(cond, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return bool(cond())


def _suspect(router) -> list[str]:
    return router.snapshot().get("suspect", [])


# ---------------------------------------------------------------------------------------------- the watch


def test_two_missed_probes_in_a_row_make_a_replica_suspect_and_one_answer_clears_it():
    from kvmesh.deployments.replica_watch import ReplicaWatch

    async def scenario():
        watch = ReplicaWatch(interval_s=0.01, deadline_s=0.05)
        a, b = Replica("A"), Replica("B")
        a.frozen = True
        # a hung probe is waited on for its deadline, no longer: the round ends while A still has not answered
        # (30 s only guards against a hang, 600 times the deadline)
        await asyncio.wait_for(watch.probe_once([a, b]), 30)
        assert watch.suspect == set() and watch.misses == {"A": 1}  # one miss is not enough
        await watch.probe_once([a, b])
        assert watch.suspect == {"A"} and watch.suspicions == 1
        await watch.probe_once([a, b])
        assert watch.suspicions == 1  # still the same suspicion
        a.frozen = False
        await watch.probe_once([a, b])
        assert watch.suspect == set() and watch.misses == {}
        assert (watch.answered, watch.missed) == (5, 3)
        # a slow answer between two misses breaks the run: misses must be consecutive
        a.frozen = True
        await watch.probe_once([a])
        a.frozen = False
        await watch.probe_once([a])
        a.frozen = True
        await watch.probe_once([a])
        assert watch.suspect == set()

    asyncio.run(scenario())


def test_a_replica_slow_to_answer_but_working_is_not_suspect():
    """A probe can be slow on a replica that is only busy: one whose KV events or engine steps move between
    rounds is not counted as missing it; once it shows nothing either, two misses make it suspect."""
    from kvmesh.deployments.replica_watch import ReplicaWatch

    steps = {"A": 0}

    async def scenario():
        watch = ReplicaWatch(interval_s=0.01, deadline_s=0.02, progress=lambda r: steps[r.replica_id.unique_id])
        a = Replica("A")
        a.frozen = True
        for _ in range(4):
            steps["A"] += 1  # working between rounds
            await watch.probe_once([a])
        assert watch.suspect == set() and watch.busy == 3  # the first round has nothing to compare with
        for _ in range(2):  # no answer and no work: frozen
            await watch.probe_once([a])
        assert watch.suspect == {"A"}
        steps["A"] += 1  # works again (its events arrive) while still slow to answer
        await watch.probe_once([a])
        assert watch.suspect == set()

    asyncio.run(scenario())


def test_an_answering_replica_not_ready_yet_wins_over_a_ready_suspect_one():
    """A froze (suspect) while B, new (an autoscaled replica whose routing stats have not come), answers: the
    request goes to B, not to A for being the only ready replica."""

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, **FAST)
        a, b = Replica("A", "n0"), Replica("B", "n1")
        b.routing_stats = {}
        router.update_replicas([a, b])
        a.frozen = True
        assert await _until(lambda: _suspect(router) == ["A"])
        return _ids(await router.choose_replicas([a, b], fake_request(list(range(64)), "q")))

    assert asyncio.run(scenario()) == ["B"]


def test_a_large_fleet_is_probed_at_a_bounded_rate_spread_over_the_round():
    from kvmesh.deployments.replica_watch import MAX_PROBES_PER_S, ReplicaWatch

    watch = ReplicaWatch(interval_s=1.0)
    assert watch.round_s(4) == 1.0 and watch.round_s(256) == 256 / MAX_PROBES_PER_S

    async def scenario():
        replicas = [Replica(f"r{i}") for i in range(20)]
        started: list[float] = []
        for r in replicas:
            original = r.get_queue_len

            async def timed(*, deadline_s, original=original):
                started.append(asyncio.get_running_loop().time())
                return await original(deadline_s=deadline_s)

            r.get_queue_len = timed
        await watch.probe_once(replicas, spread_s=0.2)
        return sorted(started)

    starts = asyncio.run(scenario())
    assert len(starts) == 20 and 0.17 <= starts[-1] - starts[0] <= 0.3  # not one burst
    assert max(b - a for a, b in zip(starts, starts[1:])) < 0.05


def test_with_every_replica_suspect_all_are_ranked_and_departed_replicas_are_dropped():
    from kvmesh.deployments.replica_watch import ReplicaWatch

    watch = ReplicaWatch()
    a, b = Replica("A"), Replica("B")
    for _ in range(2):
        watch.record("A", False)
    assert watch.unsuspected([a, b]) == [b]
    for _ in range(2):
        watch.record("B", False)
    assert watch.unsuspected([a, b]) == [a, b]  # nowhere better to send: as before
    watch.keep_only(["B"])  # A left Serve's replica set
    assert watch.suspect == {"B"} and set(watch.misses) == {"B"}


def test_the_probe_task_survives_failing_rounds_and_failing_probes():
    """A probe that fails for a reason of its own says nothing about the replica; a Ray error (unreachable
    actor) is a miss; a round that fails whole is logged and the next one runs."""
    from ray.exceptions import ActorUnavailableError

    from kvmesh.deployments.replica_watch import ReplicaWatch

    async def scenario():
        watch = ReplicaWatch(interval_s=0.01, deadline_s=0.05)
        a, b, c = Replica("A"), Replica("B"), Replica("C")
        b.fail = RuntimeError("not a replica's fault")
        c.fail = ActorUnavailableError(error_message="unreachable", actor_id=None)
        calls = {"n": 0}

        def replicas():
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyError("the replica list failed once")
            return [a, b, c]

        task = asyncio.create_task(watch.run(replicas))
        try:
            assert await _until(lambda: watch.rounds >= 3)
        finally:
            task.cancel()
        assert not task.done() or task.cancelled()  # it was running until cancelled
        assert watch.suspect == {"C"}
        assert "B" not in watch.misses and a.probes >= 3 and b.probes >= 3

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------- the router


def test_a_frozen_replica_is_left_out_of_the_ranking_and_nothing_about_it_is_forgotten():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, speculative_ttl_s=60.0, **FAST)
        a, b = Replica("A", "n0"), Replica("B", "n1")
        router.update_replicas([a, b])
        prefix = list(range(1000, 1256))  # 8 blocks
        # a prefix on one replica, and a request still running there
        req = fake_request(prefix + [1], "first")
        home = (await router.choose_replicas([a, b], req))[0][0]
        router._routed(req, home.replica_id)
        other = b if home is a else a
        hid = home.replica_id.unique_id
        assert _ids(await router.choose_replicas([a, b], fake_request(prefix + [2], "warm")))[0] == hid

        home.frozen = True
        assert await _until(lambda: hid in _suspect(router)), "a frozen replica never became suspect"
        snap = router.snapshot()
        assert snap["suspect"] == [hid] and snap["suspicions"] == 1
        for k in range(4):  # its prefix counts for nothing while it does not answer
            assert _ids(await router.choose_replicas([a, b], fake_request(prefix + [10 + k], f"q{k}"))) == [
                other.replica_id.unique_id
            ]
        # nothing forgotten: index slot and prefix, policy state, the request in flight there
        assert router.forgotten == 0 and set(router.index.replicas()) == {"A", "B"}
        assert router.held_blocks()[hid] >= 8
        assert hid in router.policy.recent_work()
        assert any(st.replica == hid for st in router._inflight.values())

        home.frozen = False  # the node resumes: one answer, and its prefix draws its requests again
        assert await _until(lambda: hid not in _suspect(router))
        assert _ids(await router.choose_replicas([a, b], fake_request(prefix + [99], "back")))[0] == hid

    asyncio.run(scenario())


def test_a_replica_a_call_found_unavailable_is_suspect_not_dead_and_ranked_again_once_it_answers():
    """Ray's ActorUnavailableError mid-stream (Serve raises it for any gRPC UNAVAILABLE, a network blip too):
    the ingress tells the routers (`notify_replica_unavailable`), which leave the replica out only until it
    answers a probe. Reported dead instead, a healthy replica was never routed to again while Serve listed it."""
    from kvmesh.deployments.router import notify_replica_unavailable

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, **FAST)
        a, b = Replica("A", "n0"), Replica("B", "n1")
        router.update_replicas([a, b])
        a.frozen = True  # the blip lasts a moment: its probes hang meanwhile
        notify_replica_unavailable("A")
        assert await _until(lambda: _suspect(router) == ["A"])
        for k in range(4):
            assert _ids(
                await router.choose_replicas([a, b], fake_request(list(range(k * 300, k * 300 + 64)), f"q{k}"))
            ) == ["B"]
        assert "A" not in router._dead and router.forgotten == 0 and set(router.index.replicas()) == {"A", "B"}
        a.frozen = False  # it answers again
        assert await _until(lambda: _suspect(router) == [])
        router.update_replicas([a, b])  # Serve's next list: both there
        ranked = set()
        for k in range(8):
            ranked |= set(
                _ids(await router.choose_replicas([a, b], fake_request(list(range(k * 300, k * 300 + 64)), f"r{k}")))
            )
        assert ranked == {"A", "B"}

    asyncio.run(scenario())


def test_a_replica_whose_probe_ray_answers_with_its_death_is_forgotten_while_serve_still_lists_it():
    """A replica killed mid-stream breaks the call with ActorUnavailableError (as a blip does), so the ingress
    only makes it suspect; its next probe gets Ray's ActorDiedError, and the router forgets it then rather
    than keeping its index slot until Serve drops it from its list some seconds later. A probe that is only
    unavailable says nothing of death."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from kvmesh.deployments.router import notify_replica_unavailable

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, **FAST)
        a, b, c = Replica("A", "n0"), Replica("B", "n1"), Replica("C", "n2")
        router.update_replicas([a, b, c])
        c.fail = ActorUnavailableError("unreachable for now", b"\x00" * 16)
        assert await _until(lambda: "C" in _suspect(router))
        assert "C" not in router._dead and "C" in router.index.replicas()
        a.fail = ActorDiedError()
        notify_replica_unavailable("A")
        assert await _until(lambda: "A" in router._dead)
        assert "A" not in router.index.replicas() and "C" not in router._dead
        router.update_replicas([a, b, c])  # Serve still lists it: it stays out
        got = {
            _ids(await router.choose_replicas([a, b, c], fake_request(list(range(k, k + 64)), f"q{k}")))[0]
            for k in range(6)
        }
        assert "A" not in got

    asyncio.run(scenario())


def test_with_every_replica_frozen_the_ranking_is_as_before():
    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, **FAST)
        a, b = Replica("A", "n0"), Replica("B", "n1")
        router.update_replicas([a, b])
        a.frozen = b.frozen = True
        assert await _until(lambda: _suspect(router) == ["A", "B"])
        assert sorted(_ids(await router.choose_replicas([a, b], fake_request(list(range(64)), "q")))) == ["A", "B"]

    asyncio.run(scenario())


def test_suspect_replicas_are_exported_as_a_gauge_and_suspicions_as_a_counter():
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text

    router = {"forgotten": 0, "routing_stats": {}, "suspect": ["A", "B"], "suspicions": 3}
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(failure_metrics_text(FailureCounters(), router))
        for s in f.samples
    }
    assert samples["kvmesh_router_replicas_suspect"] == 2
    assert samples["kvmesh_router_suspicions_total"] == 3


def test_calls_in_flight_on_a_long_suspect_replica_are_moved_once_and_again_if_their_new_replica_freezes(
    monkeypatch,
):
    """A replica suspect for `suspect_abandon_s` has its calls in flight given up (the ingress sends them
    elsewhere), each call once. Serve sends the ingress's new call under the request's same internal id: that
    call is given up in turn if its own replica freezes, and when Serve drops that replica."""
    from kvmesh.deployments import router as router_module

    monkeypatch.setattr(router_module, "ABANDON_AFTER_S", 0.05)  # what a dropped replica's calls wait for
    monkeypatch.setattr(local_state, "OPEN_CALLS", OpenCalls())

    async def scenario():
        router = make_router(policy="kvmesh", block_size=32, suspect_abandon_s=0.15, **FAST)
        reps = [Replica("A", "n0"), Replica("B", "n1"), Replica("C", "n2")]
        router.update_replicas(reps)
        prompt = list(range(1000, 1256))
        gone: list[str] = []

        async def send(call: str):
            req = fake_request(prompt, "r1")  # every call of the request: internal id "i-r1", as Serve does
            home = (await router.choose_replicas(reps, req))[0][0]
            router._routed(req, home.replica_id)
            local_state.OPEN_CALLS.watch("r1", lambda: gone.append(call))
            return home

        first = await send("first call")
        first.frozen = True
        assert await _until(lambda: first.replica_id.unique_id in _suspect(router))
        await asyncio.sleep(0.05)
        assert gone == [], "given up before the replica was suspect for suspect_abandon_s"
        assert await _until(lambda: gone == ["first call"]), "the call on the frozen replica was never given up"
        await asyncio.sleep(0.2)  # rounds go on, the replica still suspect: given up once
        assert gone == ["first call"] and router.snapshot()["probes"]["calls_moved_off_suspect"] == 1

        second = await send("second call")  # the ingress sends it again; Serve asks the router anew
        assert second is not first
        second.frozen = True  # its new replica freezes too; the third still answers
        assert await _until(lambda: gone == ["first call", "second call"]), "the moved call was never moved again"
        assert router.snapshot()["probes"]["calls_moved_off_suspect"] == 2

        third = await send("third call")
        assert third not in (first, second)
        router.update_replicas([r for r in reps if r is not third])  # Serve drops its replica: given up 0.05 s on
        assert await _until(lambda: gone == ["first call", "second call", "third call"])
        assert router._moved_off == set(), "a given-up call's mark outlived it"
        first.frozen = second.frozen = False

    asyncio.run(scenario())


async def _one_call_on_two(request_id: str, movable: bool = True):
    """A router over replicas A and B (moving calls 0.05 s into a suspicion) with one call in flight, watched
    in the open-call registry: (router, A, B, the call's replica, the calls given up so far)."""
    router = make_router(policy="kvmesh", block_size=32, suspect_abandon_s=0.05, **FAST)
    a, b = Replica("A", "n0"), Replica("B", "n1")
    router.update_replicas([a, b])
    req = fake_request(list(range(64)), request_id)
    home = (await router.choose_replicas([a, b], req))[0][0]
    router._routed(req, home.replica_id)
    gone: list[int] = []
    local_state.OPEN_CALLS.watch(request_id, lambda: gone.append(1), movable=movable)
    return router, a, b, home, gone


def test_with_every_replica_frozen_no_call_is_moved(monkeypatch):
    """Nowhere better to send: calls on a frozen fleet wait for it as before."""
    monkeypatch.setattr(local_state, "OPEN_CALLS", OpenCalls())

    async def scenario():
        router, a, b, _, gone = await _one_call_on_two("r2")
        a.frozen = b.frozen = True
        assert await _until(lambda: _suspect(router) == ["A", "B"])
        await asyncio.sleep(0.3)
        assert gone == [] and router.snapshot()["probes"]["calls_moved_off_suspect"] == 0
        a.frozen = b.frozen = False

    asyncio.run(scenario())


def test_a_call_with_no_move_left_waits_for_its_suspect_replica_but_not_for_a_dropped_one(monkeypatch):
    """Given up, a request with no move left (`max_migrations`) would fail with a 503: on a suspect replica,
    which may answer yet, it waits; on one Serve dropped, which will not, it is given up as before."""
    from kvmesh.deployments import router as router_module

    monkeypatch.setattr(router_module, "ABANDON_AFTER_S", 0.05)
    monkeypatch.setattr(local_state, "OPEN_CALLS", OpenCalls())

    async def scenario():
        router, a, b, home, gone = await _one_call_on_two("r3", movable=False)
        home.frozen = True
        assert await _until(lambda: _suspect(router) == [home.replica_id.unique_id])
        await asyncio.sleep(0.3)
        assert gone == [] and router.snapshot()["probes"]["calls_moved_off_suspect"] == 0
        router.update_replicas([b if home is a else a])
        assert await _until(lambda: gone == [1]), "a dropped replica's call was not given up"
        home.frozen = False

    asyncio.run(scenario())

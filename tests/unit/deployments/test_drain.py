"""The drain before a local stop counts each engine replica on its own: a replica still waiting for
resources (an autoscaling scale-up) or one stopped meanwhile (a scale-down) is skipped, and the drain
keeps waiting on the replicas that answered instead of cutting their streams."""

from __future__ import annotations

import logging

import pytest
import ray
from ray.exceptions import ActorDiedError, GetTimeoutError

from kvmesh.deployments import drain as D

PENDING = object()  # a replica waiting for resources: its answer never comes
WAITED: list[float] = []  # the timeouts the faked ray.wait ran out (answers asked for that never came)
APP = "kvmesh"


def _name(tag: str) -> str:
    return f"{D.REPLICA_PREFIX}{APP}#EngineReplica#{tag}"


class _Ref:
    def __init__(self, value):
        self.value = value


class _Replica:
    """Answers its scripted counts in turn (the last one repeats); PENDING never answers, an exception is
    the actor dying before its answer."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.asked = 0

        class _Method:
            def remote(inner):
                value = self.answers[min(self.asked, len(self.answers) - 1)]
                self.asked += 1
                return _Ref(value)

        self.get_num_ongoing_requests = _Method()


@pytest.fixture
def fleet(monkeypatch):
    replicas: dict[str, _Replica] = {}
    gone: set[str] = set()  # listed, but stopped before get_actor
    WAITED.clear()

    def get_actor(name, namespace=None):
        if name in gone:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return replicas[name]

    def wait(refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.value is not PENDING]
        if len(ready) < num_returns and timeout:
            WAITED.append(timeout)  # the answers asked for never came: the whole timeout passed
        return ready, [r for r in refs if r.value is PENDING]

    def get(refs, timeout=None):
        if isinstance(refs, list):  # the whole fleet in one call
            if any(r.value is PENDING for r in refs):
                raise GetTimeoutError("Get timed out: some object(s) not ready.")
            return [get(r) for r in refs]
        if isinstance(refs.value, BaseException):
            raise refs.value
        if refs.value is PENDING:
            raise GetTimeoutError("Get timed out")
        return refs.value

    monkeypatch.setattr(
        ray.util,
        "list_named_actors",
        lambda all_namespaces=True: (
            [{"name": n, "namespace": "serve"} for n in replicas]
            + [{"name": "SERVE_CONTROLLER_ACTOR", "namespace": "serve"}]
        ),
    )
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(D.time, "sleep", lambda s: None)
    monkeypatch.setattr(D, "starting_replicas", lambda app: 0)  # Serve's status: see the test that sets it
    return replicas, gone


def test_a_replica_waiting_for_resources_does_not_end_the_drain_of_the_others(fleet, caplog):
    replicas, _ = fleet
    replicas[_name("keep")] = keep = _Replica(3, 2, 1, 0)
    replicas[_name("new")] = new = _Replica(PENDING)
    with caplog.at_level(logging.WARNING, logger=D.__name__):
        assert D.drain(APP, timeout_s=60) == 0
    assert keep.asked == 4  # polled until its streams finished
    assert new.asked == 1  # not asked again once it did not answer
    skipped = [r for r in caplog.records if _name("new") in r.getMessage()]
    assert len(skipped) == 1 and "no answer" in skipped[0].getMessage()


def test_a_replica_serve_reports_starting_is_not_waited_for(fleet, monkeypatch, caplog):
    """An autoscaling replica still waiting for resources answers nothing; Serve's status says one is starting,
    so each poll waits only for the running replica's answer (it waited the whole count timeout for the
    pending one first, 10 s of every stop), and the pending one is asked again, not given up."""
    replicas, _ = fleet
    replicas[_name("keep")] = keep = _Replica(2, 1, 0)
    replicas[_name("new")] = new = _Replica(PENDING)
    monkeypatch.setattr(D, "starting_replicas", lambda app: 1)
    with caplog.at_level(logging.WARNING, logger=D.__name__):
        assert D.drain(APP, timeout_s=60) == 0
    assert WAITED == []  # no poll ran out its timeout
    assert keep.asked == 3 and new.asked == 3
    assert not [r for r in caplog.records if _name("new") in r.getMessage()]
    monkeypatch.setattr(D, "starting_replicas", lambda app: 0)  # Serve's status not had: waited for, as before
    keep.asked, keep.answers = 0, [0]
    assert D.drain(APP, timeout_s=60) == 0 and WAITED != []


def test_a_replica_stopped_meanwhile_is_skipped_and_the_healthy_one_counted(fleet):
    replicas, gone = fleet
    replicas[_name("keep")] = _Replica(3)
    replicas[_name("dying")] = _Replica(ActorDiedError())
    replicas[_name("gone")] = _Replica(5)
    gone.add(_name("gone"))  # listed, then stopped before get_actor found it
    assert D.in_flight(APP) == 3
    assert D.drain(APP, timeout_s=0) == 3  # still in flight when the bound passed: not "drained"


def test_nothing_countable_stops_at_once(fleet, monkeypatch):
    replicas, _ = fleet
    assert D.in_flight(APP) == 0  # no replica: nothing in flight
    replicas[_name("dying")] = _Replica(ActorDiedError())
    assert D.in_flight(APP) is None  # listed, but none could be counted
    assert D.drain(APP, timeout_s=60) == 0

    def broken(all_namespaces=True):
        raise RuntimeError("GCS unreachable")

    monkeypatch.setattr(ray.util, "list_named_actors", broken)
    assert D.in_flight(APP) is None
    assert D.drain(APP, timeout_s=60) == 0

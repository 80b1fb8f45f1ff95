"""A load report's named requests are looked up once per report: a router ranks many times per stats
period, and only the requests no router knew of can change their answer before the next report."""

from __future__ import annotations

from kvmesh.deployments.load_report import LoadReports


class Known:
    """The routers' knowledge, counting lookups."""

    def __init__(self, ids=()):
        self.ids = set(ids)
        self.lookups = 0
        self.generation = 0

    def __call__(self, request_id: str) -> bool:
        self.lookups += 1
        return request_id in self.ids


def test_a_report_is_read_once_and_only_its_unknown_requests_are_looked_up_again():
    known = Known({f"k{i}" for i in range(8)})
    reports = LoadReports(known, lambda: known.generation)
    stats = {"queued_ids": [f"k{i}" for i in range(4)] + ["x"], "running_ids": [f"k{i}" for i in range(4, 8)]}
    assert reports.load("A", stats, 4, 4, ()) == (5, 4)
    assert known.lookups == 9
    for _ in range(10):  # rankings before the next report
        assert reports.load("A", stats, 4, 4, ()) == (5, 4)
    assert known.lookups == 9 + 10  # x, each time
    stats = dict(stats, queued_ids=list(stats["queued_ids"]))  # the next report: read anew
    reports.load("A", stats, 4, 4, ())
    assert known.lookups == 9 + 10 + 9


def test_a_request_heard_of_after_the_report_stops_counting_as_unknown():
    """A peer's placement message can arrive after the engine's report naming it."""
    known = Known()
    reports = LoadReports(known, lambda: known.generation)
    stats = {"queued_ids": ["p0"], "running_ids": []}
    assert reports.load("A", stats, 0, 0, ()) == (1, 0)
    known.ids.add("p0")  # now counted among the routers' own (queued=1)
    assert reports.load("A", stats, 1, 0, ()) == (1, 0)


def test_requests_no_longer_known_without_ending_count_again_once_the_generation_changes():
    known = Known({"p0"})
    reports = LoadReports(known, lambda: known.generation)
    stats = {"queued_ids": [], "running_ids": ["p0"]}
    assert reports.load("A", stats, 0, 1, ()) == (0, 1)
    known.ids.clear()  # its router dropped unheard: it may still run
    known.generation += 1
    assert reports.load("A", stats, 0, 0, ()) == (0, 1)


def test_this_routers_waiting_request_the_engine_runs_counts_as_running():
    known = Known({"q0", "q1"})
    reports = LoadReports(known, lambda: known.generation)
    stats = {"queued_ids": ["q1"], "running_ids": ["q0"]}
    assert reports.load("A", stats, 2, 0, {"q0", "q1"}) == (1, 1)
    assert reports.load("A", stats, 1, 1, {"q1"}) == (1, 1)  # q0's first token is back: the router counts it


def test_a_report_without_names_takes_the_larger_count_and_forget_drops_a_reading():
    known = Known()
    reports = LoadReports(known, lambda: known.generation)
    assert reports.load("A", {"queued": 3, "running": 1}, 2, 2, ()) == (3, 2)
    reports.load("A", {"queued_ids": ["x"], "running_ids": []}, 0, 0, ())
    assert "A" in reports._readings
    reports.forget("A")
    assert reports._readings == {}

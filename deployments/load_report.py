"""An engine's load report read against what the routers know: the work in it no router here placed.

Why: a report is up to a stats period old, so a request it names that ended since must not count again,
while work no router here knows of (an ingress replica restarted, a peer's stream lag) must. Which of a
report's requests are unknown is worked out once per report, not on every ranking: a router ranks many
times per stats period, and a fleet of 256 replicas naming 8 requests each is 2,000 lookups a ranking."""

from __future__ import annotations

from collections.abc import Callable, Collection


class _Reading:
    """One report's requests, and those of them no router knew of when last looked at."""

    __slots__ = ("queued_ids", "running_ids", "running", "unknown_queued", "unknown_running", "generation")

    def __init__(self, queued_ids: list, running_ids: list, known: Callable[[str], bool], generation: int):
        self.queued_ids = queued_ids  # the report's own lists: a new report is new lists
        self.running_ids = running_ids
        self.running = set(running_ids)
        self.unknown_queued = [i for i in queued_ids if not known(i)]
        self.unknown_running = [i for i in running_ids if not known(i)]
        self.generation = generation


class LoadReports:
    """Per replica, the reading of its latest load report.

    `known(request_id)`: a router here placed it (in flight, or ended lately). `generation()` changes when
    requests a router knew of stop being known without having ended (a peer gone silent, its placements
    dropped unheard): those may still run, so every reading is taken again. Otherwise a known request
    stays known for longer than a report is current (an ended one is kept among the ended for thousands of
    ends), and an unknown one may become known (a peer's placement heard after the engine's report), so
    only the unknown are looked up again."""

    def __init__(self, known: Callable[[str], bool], generation: Callable[[], int]):
        self.known = known
        self.generation = generation
        self._readings: dict[str, _Reading] = {}

    def load(self, replica: str, stats: dict, queued: int, running: int, waiting: Collection[str]) -> tuple[int, int]:
        """A replica's (queued, running): what the routers here sent there (`queued`, `running`: exact and
        fresh; `waiting`: this router's requests there with no first token back yet) and the engine's
        report for the rest.

        The report names its requests (`queued_ids`, `running_ids`). Those a router here knows of are
        counted as they know them, so a request that ended since the report is not counted again; the
        others are added. One of this router's requests the engine names as running has started though
        its first token is not back yet (a unary call hears of it only at its end): it counts as running,
        not also as queued. A report without the names (too many, an older engine): each count is the
        larger of the two, which counts a request that ended since the report again."""
        queued_ids, running_ids = stats.get("queued_ids"), stats.get("running_ids")
        if not isinstance(queued_ids, list) or not isinstance(running_ids, list):
            self._readings.pop(replica, None)
            return max(queued, int(stats.get("queued", 0))), max(running, int(stats.get("running", 0)))
        r = self._reading(replica, queued_ids, running_ids)
        started = sum(1 for i in waiting if i in r.running) if waiting else 0
        return queued - started + len(r.unknown_queued), running + started + len(r.unknown_running)

    def _reading(self, replica: str, queued_ids: list, running_ids: list) -> _Reading:
        generation = self.generation()
        r = self._readings.get(replica)
        same = r is not None and r.queued_ids is queued_ids and r.running_ids is running_ids
        if r is None or not same or r.generation != generation:
            r = self._readings[replica] = _Reading(queued_ids, running_ids, self.known, generation)
            return r
        known = self.known
        if r.unknown_queued:
            r.unknown_queued = [i for i in r.unknown_queued if not known(i)]
        if r.unknown_running:
            r.unknown_running = [i for i in r.unknown_running if not known(i)]
        return r

    def forget(self, replica: str) -> None:
        self._readings.pop(replica, None)

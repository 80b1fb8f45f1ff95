"""Suspect replicas: engine replicas that stopped answering, left out of routing until they answer again.

Why: a replica on a node that froze or was cut off fails nothing. Ray declares the node dead only after
about a minute, and until then Serve keeps sending there blind: its queue-length cache skips the probe
while its entry is fresh, and every send refreshes the entry. The router's own view of the replica is
frozen too (routing stats arrive only when they change). So a router background task asks every replica
Serve lists for its queue length (Serve's own call, `RunningReplica.get_queue_len`) once a second; a
replica that misses `MISSES_TO_SUSPECT` probes in a row is suspect, and one answer clears it. A replica a
call found unreachable (Ray's ActorUnavailableError, `suspect_now`) is suspect at once, cleared the same way.

A probe can also be slow on a replica that is only busy (its engine holding the event loop it answers
from): one that showed work since the last round (`progress`: a new KV event, a new engine step in its
routing stats) is not counted as missing it, so a false alarm needs a replica that neither answers nor works.

Suspicion is not death: nothing the router keeps about the replica is dropped (index slot, KV-event
subscriber, policy state), so a node that resumes gets its traffic back at once. Its calls in flight would
wait for the resume, or for Ray to declare the node dead (about a minute): once it has been suspect for
`SUSPECT_ABANDON_S` and some replica answers, every round hands it to `abandon`, with which the router gives
up its open calls there and the ingress sends them elsewhere (deployments/migration.py). A node that resumes
after that has done their work twice: the price of not hanging them.
The task runs off the request path; ranking only reads `suspect`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayError

log = logging.getLogger("ray.serve.kvmesh")

# A probe a second per replica: a frozen replica is suspect 2-5 s after it froze (two missed probes, each waited
# on for PROBE_DEADLINE_S), and one that resumes is routed to within about a second.
PROBE_INTERVAL_S = 1.0
# How long a probe may take before it counts as missed. A replica answers from the event loop its engine
# driver shares, and the router reads the answer on the ingress's loop: on a 2-core machine running two
# engines under 12-24 clients' constant load the slowest answer seen was 0.26 s, so 1 s leaves a margin of
# about four, and a false alarm takes two slow answers in a row.
PROBE_DEADLINE_S = 1.0
MISSES_TO_SUSPECT = 2
# At most this many probes a second from one router, spread over the round: each costs the ingress's event
# loop, its request path, about 0.6 ms here, so a large fleet is probed less often (256 replicas: every 2.6
# s, a frozen one suspect within about 6 s) rather than in one burst that stalls the loop.
MAX_PROBES_PER_S = 100.0
# How long a replica stays suspect (no answer, no sign of work) before its calls in flight are moved: with the
# suspicion 2-5 s after the freeze, they move 10-14 s after it (seen live: 13.2 s), against about a minute for
# Ray to declare the node dead. Longer than the longest engine step seen without a KV event or a step count.
SUSPECT_ABANDON_S = 8.0


class ReplicaWatch:
    """Probe state per replica id: consecutive misses, the suspect set and counters for /kvmesh/state."""

    def __init__(
        self,
        interval_s: float | None = None,
        deadline_s: float | None = None,
        misses_to_suspect: int = MISSES_TO_SUSPECT,
        progress: Callable[[Any], Hashable] | None = None,
        abandon: Callable[[str], int] | None = None,
        abandon_after_s: float | None = None,
        died: Callable[[str], None] | None = None,
    ) -> None:
        self.interval_s = PROBE_INTERVAL_S if interval_s is None else interval_s
        self.deadline_s = PROBE_DEADLINE_S if deadline_s is None else deadline_s
        self.misses_to_suspect = misses_to_suspect
        # per replica, a token that changes when it shows work (None: no such sign is read)
        self.progress = progress
        self._progress_seen: dict[str, Hashable] = {}
        # gives up the calls in flight on a replica suspect for `abandon_after_s`; how many it gave up
        self.abandon = abandon
        self.abandon_after_s = SUSPECT_ABANDON_S if abandon_after_s is None else abandon_after_s
        # told of a replica whose probe Ray answered with its death (ActorDiedError): a call that broke on it
        # only made it suspect (Ray's ActorUnavailableError covers a kill as well as a blip), and Serve drops
        # it from its list only some seconds later
        self.died = died
        self.suspect_since: dict[str, float] = {}  # replica id -> when it became suspect (monotonic)
        self.abandoned = 0  # calls in flight given up on suspect replicas
        self.busy = 0  # probes missed by a replica that showed work since the last round: slow, not frozen
        self.misses: dict[str, int] = {}  # replica id -> probes missed in a row
        self.suspect: set[str] = set()
        self.suspicions = 0  # times a replica became suspect
        self.answered = 0
        self.missed = 0
        self.slowest_answer_s = 0.0  # the longest any answered probe took (what the deadline must exceed)
        self.rounds = 0
        self._failing: set[str] = set()  # replicas whose probe failed for a reason of its own (logged once)

    # ------------------------------------------------------------------ state
    def record(self, rid: str, answered: bool) -> None:
        """One probe's outcome: an answer clears the replica, a miss counts towards suspicion."""
        if answered:
            self.misses.pop(rid, None)
            if rid in self.suspect:
                self.suspect.discard(rid)
                self.suspect_since.pop(rid, None)
                log.warning("replica %s answers again: routed to again", rid)
            return
        n = self.misses[rid] = self.misses.get(rid, 0) + 1
        if n >= self.misses_to_suspect and rid not in self.suspect:
            self.suspect.add(rid)
            self.suspect_since[rid] = time.monotonic()
            self.suspicions += 1
            log.warning("replica %s missed %d queue-length probes in a row: suspect, not routed to", rid, n)

    def suspect_now(self, rid: str) -> None:
        """A call to the replica failed as unreachable (Ray's ActorUnavailableError, perhaps only a blip):
        suspect at once, as after missed probes, and cleared the same way, by one answered probe."""
        self.misses[rid] = max(self.misses.get(rid, 0), self.misses_to_suspect)
        if rid not in self.suspect:
            self.suspect.add(rid)
            self.suspect_since[rid] = time.monotonic()
            self.suspicions += 1
            log.warning("replica %s was unreachable from a call: suspect, not routed to until it answers", rid)

    def keep_only(self, rids: Iterable[str]) -> None:
        """Forget replicas no longer probed (left Serve's set, or dead): a suspicion does not outlive them."""
        keep = set(rids)
        self.suspect &= keep
        for rid in [r for r in self.suspect_since if r not in keep]:
            del self.suspect_since[rid]
        self._failing &= keep
        for rid in [r for r in self._progress_seen if r not in keep]:
            del self._progress_seen[rid]
        for rid in [r for r in self.misses if r not in keep]:
            del self.misses[rid]

    def unsuspected(self, replicas: Sequence[Any]) -> list[Any]:
        """`replicas` less the suspect ones; all of them if every one is suspect (a fleet that froze whole
        is routed as before: there is nowhere better to send)."""
        if not self.suspect:
            return list(replicas)
        kept = [r for r in replicas if r.replica_id.unique_id not in self.suspect]
        return kept or list(replicas)

    def stats(self) -> dict:
        """Probe counters (the suspect set and suspicions are the router snapshot's own keys)."""
        return {
            "answered": self.answered,
            "missed": self.missed,
            "missed_while_working": self.busy,
            "slowest_answer_s": round(self.slowest_answer_s, 4),
            "calls_moved_off_suspect": self.abandoned,
        }

    # ------------------------------------------------------------------ probing
    async def _probe(self, r: Any) -> bool | None:
        """True: answered within the deadline; False: no answer (timed out, or Ray could not reach it);
        None: the probe itself failed for another reason, which says nothing about the replica."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s):  # keeps a cancel that comes as the answer does
                await r.get_queue_len(deadline_s=self.deadline_s)
        except (TimeoutError, RayError) as exc:
            if self.died is not None and isinstance(exc, RayActorError) and not isinstance(exc, ActorUnavailableError):
                self.died(r.replica_id.unique_id)
            return False
        except Exception as exc:
            if r.replica_id.unique_id not in self._failing:
                self._failing.add(r.replica_id.unique_id)
                log.warning("queue-length probe of %s failed: %r", r.replica_id.unique_id, exc)
            return None
        self.slowest_answer_s = max(self.slowest_answer_s, time.monotonic() - t0)
        return True

    def round_s(self, replicas: int) -> float:
        """How often each replica is probed: `interval_s`, or longer for a fleet over MAX_PROBES_PER_S."""
        return max(self.interval_s, replicas / MAX_PROBES_PER_S)

    async def probe_once(self, replicas: Sequence[Any], spread_s: float = 0.0) -> None:
        """Probe every replica, their starts spread evenly over `spread_s` (no burst on the loop); each waits
        `deadline_s` at most, so a frozen one delays no other."""
        self.keep_only(r.replica_id.unique_id for r in replicas)
        n = len(replicas)

        async def staggered(i: int, r: Any) -> bool | None:
            if spread_s > 0 and i:
                await asyncio.sleep(i * spread_s / n)
            return await self._probe(r)

        outcomes = await asyncio.gather(*(staggered(i, r) for i, r in enumerate(replicas)))
        for r, outcome in zip(replicas, outcomes, strict=True):
            rid = r.replica_id.unique_id
            worked = self._worked(r, rid)
            if outcome is None:
                continue
            if outcome:
                self.answered += 1
            elif worked:
                self.busy += 1
                outcome = True  # slow to answer, but working: not a sign of a frozen node
            else:
                self.missed += 1
            self.record(rid, outcome)
        self.rounds += 1
        self.abandon_long_suspect(len(replicas))

    def abandon_long_suspect(self, probed: int) -> None:
        """Hand every replica suspect for `abandon_after_s` to `abandon`, while some probed replica is not
        suspect (with the whole fleet frozen, a moved call would only land on another frozen replica)."""
        if self.abandon is None or not self.suspect or len(self.suspect) >= probed:
            return
        now = time.monotonic()
        for rid in sorted(self.suspect):
            if now - self.suspect_since.get(rid, now) >= self.abandon_after_s:
                try:
                    self.abandoned += self.abandon(rid)
                except Exception:  # never let giving up calls end the watch
                    log.exception("replica watch: moving the calls off suspect replica %s failed", rid)

    def _worked(self, r: Any, rid: str) -> bool:
        """Has the replica shown work (`progress`) since the last round looked? The first look says no."""
        if self.progress is None:
            return False
        try:
            token = self.progress(r)
        except Exception:  # a sign that cannot be read is no sign
            return False
        before = self._progress_seen.get(rid, token)
        self._progress_seen[rid] = token
        return token != before

    async def run(self, replicas: Callable[[], Sequence[Any]]) -> None:
        """Probe `replicas()` every `interval_s` until cancelled; a failing round is logged, never fatal."""
        while True:
            t0 = time.monotonic()
            round_s = self.interval_s
            try:
                probed = replicas()
                round_s = self.round_s(len(probed))
                await self.probe_once(probed, spread_s=round_s)
            except Exception:
                log.exception("replica watch: a probe round failed")
            await asyncio.sleep(max(0.0, round_s - (time.monotonic() - t0)))

"""Which in-flight request a new request could load its prefix from, once that request's prefill ends.

Why: LMCache stores a prompt in the node's host tier and the shared tier when its prefill ends. A request
sharing a new prompt that the router ranks onto another replica before then would compute the prompt
again; the router can instead hold it until the computing request's first token is back and let it load
the prompt (`router_hold.TierHolding`, mixed into `KvmeshRouter`: `_plan_hold` and `_hold`;
`Policy.hold_worth` decides whether the wait is worth it).
Candidates are this router's own in-flight requests (it sees their first token) and the other ingress
replicas' (`router_sync.PeerPlacement`: their routers publish the first token as `started`), so a prompt a
request behind another ingress replica is computing is waited for too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol


class HoldSource:
    """An in-flight request other requests may wait for: the router's own (`router._Inflight`) or another
    ingress replica's (`router_sync.PeerPlacement`). `released()` is set once its first token is back, or
    once it will never come (moved, failed, its router gone)."""

    __slots__ = ("_released",)

    def __init__(self) -> None:
        self._released: asyncio.Event | None = None  # made when a request first waits for it

    def released(self) -> asyncio.Event:
        if self._released is None:
            self._released = asyncio.Event()
        return self._released

    def release(self) -> None:
        """Requests waiting for it go on."""
        if self._released is not None:
            self._released.set()

    def prefill_end_s(self, pace: float = 1.0) -> float:
        """When (time.monotonic()) its prefill is predicted to end, its predicted time taken `pace` times as
        long (each kind of source says from when and by which prediction: `prefill_end_s` below)."""
        raise NotImplementedError

    def prefill_left_s(self) -> float:
        """Predicted seconds until its prefill ends; 0 when nothing predicts it or that time has passed.
        Computed only when a request considers waiting for it."""
        return max(self.prefill_end_s() - time.monotonic(), 0.0)


def prefill_end_s(since: float, predict, info, view, pace: float = 1.0) -> float:
    """When (time.monotonic()) the prefill of `info`, placed at `since` on a replica ranked as `view`, is
    predicted to end: `predict` is a policy's (TTFT first), its time taken `pace` times as long."""
    return since + pace * predicted_ttft_s(predict, info, view)


def predicted_ttft_s(predict, info, view) -> float:
    """`predict`'s (a policy's) TTFT for `info` on a replica ranked as `view`; 0 when nothing predicts it."""
    return 0.0 if predict is None or view is None else float(predict(info, view)[0])


def pace_of_waiting(waiting: Iterable[tuple[float, float]]) -> float:
    """The median of (seconds since placement) / (predicted TTFT) over requests still waiting for their first
    token, given as (elapsed, predicted) pairs: each one's pace is at least that (the lower median of an even
    count). 0 when there are none (or none is predicted)."""
    ratios = sorted(elapsed / predicted for elapsed, predicted in waiting if predicted > 0.0)
    return ratios[(len(ratios) - 1) // 2] if ratios else 0.0


class PrefillPace:
    """How many times as long as its policy predicts the router's requests take to their first token: a
    running mean of (seconds from placement to first token) / (predicted TTFT), never below 1.

    Why: a hold waits for the computing request's first token at most twice the rest of its predicted prefill
    plus 0.5 s, so that a wrong prediction cannot strand the held request. The prediction is the policy's
    cost model, one accelerator per replica; engines slower than that (CPU engines sharing cores, a loaded or
    slower accelerator) outlast the limit, and the held request then computes the prefix again while its
    source is about to store it (live, eval draw 2084 with LMCache and one core busy elsewhere: one of six
    holds ran out, hit 0.265 against the bound's 0.290). Scaled by the pace the router measures on its own
    requests, the limit bounds a wrong prediction, not a slow machine."""

    weight = 0.1  # of the newest request in the running mean

    def __init__(self) -> None:
        self._mean: float | None = None

    @property
    def value(self) -> float:
        return 1.0 if self._mean is None else max(1.0, self._mean)

    def observe(self, actual_s: float, predicted_s: float) -> None:
        if not (predicted_s > 0.0 and actual_s >= 0.0):
            return
        ratio = actual_s / predicted_s
        self._mean = ratio if self._mean is None else self._mean + self.weight * (ratio - self._mean)


class _Stored(Protocol):
    def stored_prefix(self, src_replica: str, dst_replica: str, n_blocks: int) -> int: ...


def common_blocks(a: Sequence, b: Sequence) -> int:
    """Leading blocks two prompts share. vLLM's block hashes are chained (each names its whole prefix),
    so equality at one position implies it at every earlier one: a binary search finds the boundary."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def loadable_sources(
    hashes: Sequence,
    request_id: str | None,
    replicas: Sequence[str],
    have: Sequence[int],
    inflight: Iterable[Any],
    tiers: _Stored,
) -> list[tuple[Any, int] | None]:
    """Per replica in `replicas`: (the in-flight request leaving the most of `hashes` loadable there beyond
    the replica's `have` blocks, those blocks), or None. `inflight` holds objects with `replica` and `info`
    (a RequestInfo); one on the replica itself is skipped (that prefix is in its hbm), and so is the request
    itself. One pass over `inflight` serves every replica."""
    lo = min(have, default=0)
    found = []  # (source, blocks it shares with the request), for sources sharing more than `lo` blocks
    for st in inflight:
        if request_id and st.info.request_id == request_id:
            continue
        other = st.info.block_hashes
        if len(other) <= lo or len(hashes) <= lo or other[lo] != hashes[lo]:
            continue  # shares no more than `lo` (chained hashes: equal there means equal before)
        found.append((st, common_blocks(hashes, other)))
    out: list[tuple[Any, int] | None] = []
    for rid, own in zip(replicas, have):
        best, most = None, own
        for st, shared in found:
            if st.replica == rid or shared <= most:
                continue
            # whole chunks of the shared part: a chunk past where the prompts part is keyed by other tokens
            blocks = tiers.stored_prefix(st.replica, rid, shared)
            if blocks > most:
                best, most = st, blocks
        out.append((best, most) if best is not None else None)
    return out


def loadable_source(
    hashes: Sequence, request_id: str | None, target: str, have: int, inflight: Iterable[Any], tiers: _Stored
) -> tuple[Any, int] | None:
    """`loadable_sources` for one replica, `target`."""
    return loadable_sources(hashes, request_id, [target], [have], inflight, tiers)[0]


def loadable_prefixes(
    hashes: Sequence, request_id: str | None, replicas: Sequence[str], have: Sequence[int], inflight, tiers: _Stored
) -> tuple[list[int] | None, float]:
    """`prefixes_from` the `loadable_sources` of every replica."""
    return prefixes_from(loadable_sources(hashes, request_id, replicas, have, inflight, tiers), have)


def prefixes_from(
    found: Sequence[tuple[Any, int] | None], have: Sequence[int], left_s: Callable[[Any], float] | None = None
) -> tuple[list[int] | None, float]:
    """(per replica, the longest prefix it could load once a request in flight has stored its prefill,
    never less than its `have`; the predicted seconds until the prefill leaving the longest such prefix
    ends, 0 once its first token is back), or (None, 0.0) when no replica gains: what the policy scores a
    hold by (`FleetView.inflight_blocks`) before it ranks. `found` is `loadable_sources`'s answer; `left_s`
    reads a source's seconds left (default `prefill_left_s`, at the predicted pace)."""
    out, best = list(have), None
    for k, f in enumerate(found):
        if f is not None:
            out[k] = f[1]
            if best is None or f[1] > best[1]:
                best = f
    if best is None:
        return None, 0.0
    src = best[0]
    return out, 0.0 if src.first_token else (src.prefill_left_s() if left_s is None else left_s(src))

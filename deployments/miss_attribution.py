"""Why each uncached prompt token missed, as the fleet saw it: the server side of `kvmesh cachetest`'s miss
attribution, behind `GET /kvmesh/explain/{request_id}` and the `kvmesh_miss_tokens_total` counters.

The router knows what a client cannot: at placement, which replicas and tiers held how much of the
request's prefix (its index), which replica it chose and why. This module keeps that record per
request (`placed`, called by the router) and, when the ingress learns the delivered cached tokens
(`delivered`), splits the uncached tokens with `cluster/miss_reasons.attribute`, using what the fleet
has computed since start-up (the request's salted block hashes per tenant, and unsalted ones for
`isolated`). Drift needs the text of earlier prompts, so only the client (`cluster/cachetest_analysis.py`)
reports it; the server counts those tokens as `cold`.

Thread-safe: the router writes from its event loop, the ingress from its own. Bounded: the oldest
records and the least recently computed blocks are dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.cluster.block_cache import leading_held
from kvmesh.cluster.miss_reasons import attribute
from kvmesh.deployments.recent import RecentSet
from kvmesh.kvstore.hashing import HashMemo, block_hashes


def placement_reason(chosen: str, first_choice: str, best: str | None, views: dict) -> str:
    """Why the request did not go where most of its prefix was: Serve moved it (queue probe timed out,
    replica full), the policy saw more work queued there (load), or the balance guard held it back."""
    if chosen != first_choice:
        return "serve_fallback"
    if best is None or best == chosen:
        return ""
    b, c = views.get(best), views.get(chosen)
    if b is not None and c is not None:
        work_b = b.queued + b.running + b.pending_prefill_tokens / 1000.0
        work_c = c.queued + c.running + c.pending_prefill_tokens / 1000.0
        if work_b > work_c:
            return "load"
    return "balance_guard"


class MissAttribution:
    def __init__(self, max_requests: int = 50_000, max_blocks: int = 1_000_000):
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._records: OrderedDict[str, dict] = OrderedDict()
        self._computed: dict[str, RecentSet] = {}  # tenant -> salted blocks computed (any replica)
        self._unsalted: dict[str, RecentSet] = {}  # tenant -> the same blocks without salt
        self._max_blocks = max_blocks
        self._memo = HashMemo()
        self.counters: dict[tuple[str, str], int] = {}  # (reason, tenant) -> tokens

    def placed(
        self,
        request_id: str | None,
        replica: str,
        first_choice: str,
        matches: dict,
        block_hashes_: Sequence[int],
        block_size: int,
        views: dict | None = None,
        tier_blocks: int = 0,
        tenant: str | None = None,
    ) -> None:
        """The router's record at placement: per replica the longest prefix held in any tier (blocks), as
        the engine can load it (whole LMCache chunks); `tier_blocks`: the longest prefix a reachable tier
        held before that cut. With `tenant`, also how much of the prefix the fleet had computed for that
        tenant by now. Why then and not at delivery: two requests sent together that share a new prefix
        both compute it, and the one whose first token comes second would otherwise find the prefix
        computed (by the other, meanwhile) and count it `evicted`; at placement it was `cold`."""
        if not request_id:
            return
        seen = None
        if tenant is not None:
            with self._lock:
                computed = self._computed.get(tenant)
                seen = leading_held(block_hashes_, computed) if computed is not None else 0
        best_len = {rid: int(m[2]) for rid, m in matches.items()}
        elsewhere = max((v for rid, v in best_len.items() if rid != replica), default=0)
        best = max(best_len, key=lambda r: (best_len[r], r == replica), default=None)
        rec = {
            "request_id": request_id,
            "replica": replica,
            "first_choice": first_choice,
            "prefix_blocks": best_len,
            "predicted_blocks": best_len.get(replica, 0),
            "elsewhere_blocks": elsewhere,
            "router_reason": placement_reason(replica, first_choice, best, views or {}) if elsewhere else "",
            "tier_blocks": tier_blocks,
            "seen_at_placement": seen,
            "block_size": block_size,
            "hashes": list(block_hashes_),
        }
        with self._lock:
            self._records[request_id] = rec
            while len(self._records) > self.max_requests:
                self._records.popitem(last=False)

    def delivered(self, request_id: str, tenant: str, token_ids: Sequence[int], cached: int) -> dict | None:
        """Attribute the request's uncached tokens (None when the router never placed it)."""
        with self._lock:
            rec = self._records.get(request_id)
        if rec is None:
            return None
        bs, hashes = rec["block_size"], rec["hashes"]
        unsalted = block_hashes(token_ids, bs, memo=self._memo)
        with self._lock:
            computed = self._computed_for(tenant)
            seen = rec.get("seen_at_placement")
            if seen is None:  # placed without its tenant: what the fleet has computed by now
                seen = leading_held(hashes, computed)
            isolated = max(
                (leading_held(unsalted, held) for t, held in self._unsalted.items() if t != tenant), default=0
            )
            reasons = attribute(
                len(token_ids),
                cached,
                bs,
                seen_blocks=seen,
                isolated_blocks=isolated,
                elsewhere_blocks=rec["elsewhere_blocks"],
                tier_blocks=rec["tier_blocks"],
            )
            computed.update(hashes)
            self._unsalted.setdefault(tenant, RecentSet(self._max_blocks)).update(unsalted)
            for reason, tokens in reasons.items():
                self.counters[(reason, tenant)] = self.counters.get((reason, tenant), 0) + tokens
            rec.pop("hashes", None)
            rec.update(
                tenant=tenant,
                prompt_tokens=len(token_ids),
                cached_tokens=cached,
                seen_blocks=seen,
                miss_tokens=reasons,
            )
        return reasons

    def started(self, request_id: str, tenant: str) -> None:
        """The request's first token came back: its prompt is computed now, though a stream's usage (and so
        `delivered`) comes only at its end. A request placed meanwhile on the same prefix finds it computed,
        as other ingress replicas do from the placement stream's `started`. Only for a request whose seen
        prefix was taken at placement: one without it takes it at delivery, which must not count its own
        prompt."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.get("seen_at_placement") is None or "hashes" not in rec:
                return
            self._computed_for(tenant).update(rec["hashes"])

    def computed(self, tenant: str, hashes: Sequence[int]) -> None:
        """Blocks another ingress replica's request computed for `tenant` (its first token came back, as its
        router's placement stream says): seen fleet-wide, so a later miss on them here is `evicted` or
        `misrouted`, not `cold`. Only the salted hashes travel, so `isolated` stays per ingress replica."""
        with self._lock:
            self._computed_for(tenant).update(hashes)

    def _computed_for(self, tenant: str) -> RecentSet:
        """The blocks the fleet has computed for `tenant` (the caller holds the lock)."""
        return self._computed.setdefault(tenant, RecentSet(self._max_blocks))

    def explain(self, request_id: str) -> dict | None:
        with self._lock:
            rec = self._records.get(request_id)
            return None if rec is None else {k: v for k, v in rec.items() if k != "hashes"}

    def prometheus_text(self) -> str:
        lines = [
            "# HELP kvmesh_miss_tokens_total Uncached prompt tokens by reason and tenant (see docs/cachetest.md).",
            "# TYPE kvmesh_miss_tokens_total counter",
        ]
        with self._lock:
            items = sorted(self.counters.items())
        for (reason, tenant), tokens in items:
            t = tenant.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # the text format's escapes
            lines.append(f'kvmesh_miss_tokens_total{{reason="{reason}",tenant="{t}"}} {tokens}')
        return "\n".join(lines) + "\n"


def tenant_view(rec: dict) -> dict:
    """A request's record as its own tenant may read it: tokens another tenant's copy of the prefix would have
    served (`isolated`) count as `cold`, since telling them apart says which prompts other tenants sent."""
    reasons = rec.get("miss_tokens")
    if not reasons or "isolated" not in reasons:
        return rec
    merged = {k: v for k, v in reasons.items() if k != "isolated"}
    merged["cold"] = merged.get("cold", 0) + reasons["isolated"]
    return {**rec, "miss_tokens": merged}


# One per process: the router (in the ingress process) and the ingress share it, as they share the ledger.
ATTRIBUTION = MissAttribution()

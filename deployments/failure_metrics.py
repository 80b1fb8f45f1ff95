"""Prometheus lines for failures the serving path absorbed: request migrations, migrations given up,
replicas the router forgot or holds suspect, and engine replicas that cannot read their own routing stats.

Why a module of its own: these are the signals an operator alarms on when engines die or vLLM's
internals change shape, and they must show up even when nothing else about a request looks wrong.
"""

from __future__ import annotations

import threading
from collections import Counter


class FailureCounters:
    """Ingress-side counters (thread-safe: the ingress's request tasks and /metrics read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.migrations: Counter[str] = Counter()  # reason ("before_first_token" | "mid_stream") -> count
        self.exhausted = 0  # requests answered 503 after max_migrations

    def migrated(self, reason: str) -> None:
        with self._lock:
            self.migrations[reason] += 1

    def gave_up(self) -> None:
        with self._lock:
            self.exhausted += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"migrations": dict(self.migrations), "exhausted": self.exhausted}


def _line(out: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")


def failure_metrics_text(counters: FailureCounters, router: dict | None) -> str:
    snap = counters.snapshot()
    out: list[str] = []
    reasons = snap["migrations"]
    # the total and its split by reason in families of their own: in one family a plain sum() counted each
    # migration twice (as in serving_metrics' kvmesh_replica_* families)
    _line(
        out,
        "kvmesh_migrations_total",
        "counter",
        "requests moved to another engine replica after theirs died (before the first token or mid-stream)",
        [("", sum(reasons.values()))],
    )
    _line(
        out,
        "kvmesh_migrations_by_reason_total",
        "counter",
        "kvmesh_migrations_total by reason (before_first_token, mid_stream, unary)",
        [(f'reason="{r}"', n) for r, n in sorted(reasons.items())],
    )
    _line(
        out,
        "kvmesh_migrations_exhausted_total",
        "counter",
        "requests answered 503 after max_migrations moves",
        [("", snap["exhausted"])],
    )
    if router is not None:
        _line(
            out,
            "kvmesh_router_replicas_forgotten_total",
            "counter",
            "engine replicas the router dropped (died, or left Serve's replica set)",
            [("", router.get("forgotten", 0))],
        )
        _line(
            out,
            "kvmesh_router_replicas_suspect",
            "gauge",
            "engine replicas left out of routing because they stopped answering queue-length probes",
            [("", len(router.get("suspect") or ()))],
        )
        _line(
            out,
            "kvmesh_router_suspicions_total",
            "counter",
            "times an engine replica became suspect (missed probes in a row; one answer clears it)",
            [("", router.get("suspicions", 0))],
        )
        stats = router.get("routing_stats") or {}
        _line(
            out,
            "kvmesh_replica_stats_errors_total",
            "counter",
            "failed reads of an engine replica's own routing stats (vLLM internals); routing goes on without them",
            [(f'replica="{rid}"', int(s.get("stats_errors", 0))) for rid, s in sorted(stats.items())],
        )
    return "\n".join(out) + "\n"

"""Per-tenant serving metrics: hit rates, cached tokens, TTFT, rejections, as Prometheus text.

Why per tenant: salting splits the cache by tenant, so the global hit rate hides which tenants pay for
isolation; operators need each tenant's token-weighted hit rate (the product's key number) beside its
request-weighted one and its TTFT. Kept dependency-free (no prometheus_client registry) so several
ingress replicas or tests can each own a collector.

Definitions: token-weighted hit rate = sum(cached) / sum(prompt); request-weighted hit rate = mean over
requests of cached/prompt (each request counts once, whatever its length).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UNAUTHENTICATED = "unauthenticated"  # pseudo-tenant for rejections before a key was accepted


@dataclass
class _TenantCounters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_ratio_sum: float = 0.0  # sum over requests of cached/prompt
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS_S))
    rejections: dict[str, int] = field(default_factory=dict)


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class TenantMetrics:
    """Thread-safe collector the ingress calls once per finished request / per rejection."""

    def __init__(self, prefix: str = "kvmesh_tenant"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantCounters] = {}

    def _get(self, tenant_id: str) -> _TenantCounters:
        counters = self._tenants.get(tenant_id)
        if counters is None:
            counters = self._tenants[tenant_id] = _TenantCounters()
        return counters

    def record(self, tenant_id: str, prompt_tokens: int, cached_tokens: int, ttft_s: float | None = None) -> None:
        if prompt_tokens < 0 or cached_tokens < 0 or cached_tokens > prompt_tokens:
            raise ValueError(f"need 0 <= cached_tokens <= prompt_tokens, got {cached_tokens}/{prompt_tokens}")
        with self._lock:
            c = self._get(tenant_id)
            c.requests += 1
            c.prompt_tokens += prompt_tokens
            c.cached_tokens += cached_tokens
            c.hit_ratio_sum += cached_tokens / prompt_tokens if prompt_tokens else 0.0
            if ttft_s is not None and ttft_s >= 0:
                c.ttft_count += 1
                c.ttft_sum += ttft_s
                i = bisect.bisect_left(TTFT_BUCKETS_S, ttft_s)
                if i < len(TTFT_BUCKETS_S):
                    c.ttft_buckets[i] += 1

    def record_rejection(self, tenant_id: str | None, reason: str) -> None:
        """One refused request: an API key refused (tenant None) or admission's refusal, `reason` its code."""
        with self._lock:
            c = self._get(tenant_id or UNAUTHENTICATED)
            c.rejections[reason] = c.rejections.get(reason, 0) + 1

    def snapshot(self) -> dict[str, dict]:
        """Plain numbers per tenant (for reports and tests)."""
        with self._lock:
            out = {}
            for tid, c in self._tenants.items():
                out[tid] = {
                    "requests": c.requests,
                    "prompt_tokens": c.prompt_tokens,
                    "cached_tokens": c.cached_tokens,
                    "hit_rate_tokens": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
                    "hit_rate_requests": c.hit_ratio_sum / c.requests if c.requests else 0.0,
                    "ttft_mean_s": c.ttft_sum / c.ttft_count if c.ttft_count else None,
                    "rejections": dict(c.rejections),
                }
            return out

    def prometheus_text(self) -> str:
        """Prometheus exposition format (text 0.0.4), ready to append to the ingress's /metrics."""
        p = self.prefix
        lines = [
            f"# HELP {p}_requests_total Requests served per tenant.",
            f"# TYPE {p}_requests_total counter",
        ]
        with self._lock:
            everyone = sorted(self._tenants.items())
            items = [(t, c) for t, c in everyone if c.requests]  # rejected-only tenants: rejections only

            def emit(name, kind, help_text, rows):
                lines.extend([f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} {kind}"])
                lines.extend(rows)

            lines.extend(f'{p}_requests_total{{tenant="{_label(t)}"}} {c.requests}' for t, c in items)
            emit(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens per tenant.",
                [f'{p}_prompt_tokens_total{{tenant="{_label(t)}"}} {c.prompt_tokens}' for t, c in items],
            )
            emit(
                "cached_tokens_total",
                "counter",
                "Prompt tokens served from the KV cache per tenant.",
                [f'{p}_cached_tokens_total{{tenant="{_label(t)}"}} {c.cached_tokens}' for t, c in items],
            )
            emit(
                "hit_rate_tokens",
                "gauge",
                "Token-weighted KV cache hit rate (cached/prompt tokens).",
                [
                    f'{p}_hit_rate_tokens{{tenant="{_label(t)}"}} '
                    f"{(c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0):.6f}"
                    for t, c in items
                ],
            )
            emit(
                "hit_rate_requests",
                "gauge",
                "Request-weighted KV cache hit rate (mean per-request ratio).",
                [
                    f'{p}_hit_rate_requests{{tenant="{_label(t)}"}} '
                    f"{(c.hit_ratio_sum / c.requests if c.requests else 0.0):.6f}"
                    for t, c in items
                ],
            )
            rows = []
            for t, c in items:
                cumulative = 0
                for bound, n in zip(TTFT_BUCKETS_S, c.ttft_buckets):
                    cumulative += n
                    rows.append(f'{p}_ttft_seconds_bucket{{tenant="{_label(t)}",le="{bound:g}"}} {cumulative}')
                rows.append(f'{p}_ttft_seconds_bucket{{tenant="{_label(t)}",le="+Inf"}} {c.ttft_count}')
                rows.append(f'{p}_ttft_seconds_sum{{tenant="{_label(t)}"}} {c.ttft_sum:.6f}')
                rows.append(f'{p}_ttft_seconds_count{{tenant="{_label(t)}"}} {c.ttft_count}')
            emit("ttft_seconds", "histogram", "Time to first token per tenant.", rows)
            emit(
                "rejections_total",
                "counter",
                'Requests refused per tenant and reason (the error code): 401s (tenant "unauthenticated"), '
                "admission's 429s (the tenant's limits, or server_busy) and 400 tenant_prompt_limit_exceeded; "
                "no other 4xx.",
                [
                    f'{p}_rejections_total{{tenant="{_label(t)}",reason="{_label(r)}"}} {n}'
                    for t, c in everyone
                    for r, n in sorted(c.rejections.items())
                ],
            )
        return "\n".join(lines) + "\n"

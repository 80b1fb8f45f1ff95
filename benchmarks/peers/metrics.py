"""Per-worker counters from a vLLM OpenAI server's Prometheus /metrics. Peers do not report where they
sent each request, so the per-worker split comes from the engines themselves: a scrape before and after
a replay, and the difference. Only the counters needed are parsed (no prometheus_client dependency)."""

from __future__ import annotations

import re
import urllib.request

# metric name -> our key; summed over all label sets of that metric
COUNTERS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:request_success_total": "requests",
}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse(text: str) -> dict[str, float]:
    out = {key: 0.0 for key in COUNTERS.values()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m and m.group(1) in COUNTERS:
            out[COUNTERS[m.group(1)]] += float(m.group(3))
    return out


def scrape(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return parse(r.read().decode("utf-8", "replace"))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(round(after.get(k, 0.0) - before.get(k, 0.0))) for k in COUNTERS.values()}

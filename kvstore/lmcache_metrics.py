"""Read an LMCache MP server's Prometheus text and sum it up per tier.

The server exports OpenTelemetry counters through a Prometheus endpoint (`--prometheus-port`). Two
families matter to kvmesh: lookups (`lmcache_mp_lookup_hit_l1_tokens_total` = tokens found in this
node's host memory, `..._hit_l2_tokens_total` = tokens found only in the shared tier) and chunk
traffic (`lmcache_mp_l1_read/write_chunks_total`, `lmcache_mp_l2_*_objects_total`), from which bytes
moved follow as chunks x bytes per chunk.
"""

from __future__ import annotations

import re

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition → {metric name: [(labels, value), ...]} (comments skipped)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"not a Prometheus sample line: {line[:120]!r}")
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        out.setdefault(name, []).append((dict(_LABEL.findall(labels)), float(value)))
    return out


def total(samples: dict, name: str, **match) -> float:
    """Sum of a metric over all label sets that carry the given label values (0 when absent)."""
    return sum(v for labels, v in samples.get(name, ()) if all(labels.get(k) == w for k, w in match.items()))


def tier_summary(samples: dict, chunk_bytes: int | None = None) -> dict:
    """Per-tier figures for kvmesh's /metrics and reports.

    `chunk_bytes` (KV bytes of one LMCache chunk) turns chunk counts into bytes; when not given it is
    estimated from L1's resident bytes / resident chunks, and left None when L1 is empty.
    """
    l1_writes = total(samples, "lmcache_mp_l1_write_chunks_total")
    l1_reads = total(samples, "lmcache_mp_l1_read_chunks_total")
    l1_evicted = total(samples, "lmcache_mp_l1_evicted_chunks_total")
    l1_bytes = total(samples, "lmcache_mp_l1_memory_usage_bytes")
    if chunk_bytes is None and l1_writes - l1_evicted > 0 and l1_bytes > 0:
        chunk_bytes = int(round(l1_bytes / (l1_writes - l1_evicted)))
    l2_stored = total(samples, "lmcache_mp_l2_store_completed_objects_total")
    l2_loaded = total(samples, "lmcache_mp_l2_load_completed_objects_total") or total(
        samples, "lmcache_mp_l2_prefetch_load_completed_objects_total"
    )
    per_chunk = chunk_bytes or 0
    return {
        "lookup_requested_tokens": total(samples, "lmcache_mp_lookup_requested_tokens_total"),
        "lookup_hit_tokens": total(samples, "lmcache_mp_lookup_hit_tokens_total"),
        "host_hit_tokens": total(samples, "lmcache_mp_lookup_hit_l1_tokens_total"),
        "shared_hit_tokens": total(samples, "lmcache_mp_lookup_hit_l2_tokens_total"),
        "l1_usage_ratio": total(samples, "lmcache_mp_l1_usage_ratio"),
        "l1_resident_bytes": l1_bytes,
        "l1_write_chunks": l1_writes,
        "l1_read_chunks": l1_reads,
        "l2_stored_objects": l2_stored,
        "l2_loaded_objects": l2_loaded,
        "chunk_bytes": chunk_bytes,
        "bytes_to_host": l1_writes * per_chunk,
        "bytes_from_host": l1_reads * per_chunk,
        "bytes_to_shared": l2_stored * per_chunk,
        "bytes_from_shared": l2_loaded * per_chunk,
    }

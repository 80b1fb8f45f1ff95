"""Read an LMCache MP server's Prometheus text and sum it up per tier.

The server exports OpenTelemetry counters through a Prometheus endpoint (`--prometheus-port`); the
exporter appends each counter's unit to its name (`lmcache_mp.l2_store_completed_objects`, unit
`chunks`, is `lmcache_mp_l2_store_completed_objects_chunks_total`). Two families matter to kvmesh:
lookups (`lmcache_mp_lookup_hit_l1_tokens_total` = tokens found in this node's host memory,
`..._hit_l2_tokens_total` = tokens found only in the shared tier) and chunk traffic, below. Bytes moved
are chunks x bytes per chunk, given only when the caller knows a chunk's size (it depends on the model's
KV shape, which the server's own figures do not tell).
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


# LMCache 0.5.6's chunk counters, as its exporter names them (see the module doc). Loads from the shared tier
# are counted where each load task's result comes back: `l2_prefetch_load_completed` (unit chunks) counts the
# chunks that arrived in L1, while `l2_load_completed` (unit requests) counts load tasks, one per adapter.
L1_WRITE_CHUNKS = "lmcache_mp_l1_write_chunks_total"  # chunks stored into the node's host memory (L1)
L1_READ_CHUNKS = "lmcache_mp_l1_read_chunks_total"  # chunks read from L1 into an engine
L1_EVICTED_CHUNKS = "lmcache_mp_l1_evicted_chunks_total"
L2_STORED_CHUNKS = "lmcache_mp_l2_store_completed_objects_chunks_total"  # chunks stored into the shared tier
L2_LOADED_CHUNKS = "lmcache_mp_l2_prefetch_load_completed_chunks_total"  # chunks loaded from the shared tier


def tier_summary(samples: dict, chunk_bytes: int | None = None) -> dict:
    """Per-tier figures for kvmesh's /metrics and reports.

    Chunk counts are LMCache's own counters, so they only grow (until the server restarts). `chunk_bytes`
    (KV bytes of one LMCache chunk, a fixed figure from configuration) turns them into bytes; without it the
    `bytes_*` figures are None. Never estimated from what L1 holds at the moment: an estimate that changes
    between scrapes would make a byte counter step back.
    """
    l1_writes = total(samples, L1_WRITE_CHUNKS)
    l1_reads = total(samples, L1_READ_CHUNKS)
    l2_stored = total(samples, L2_STORED_CHUNKS)
    l2_loaded = total(samples, L2_LOADED_CHUNKS)

    def in_bytes(chunks: float) -> float | None:
        return chunks * chunk_bytes if chunk_bytes else None

    return {
        "lookup_requested_tokens": total(samples, "lmcache_mp_lookup_requested_tokens_total"),
        "lookup_hit_tokens": total(samples, "lmcache_mp_lookup_hit_tokens_total"),
        "host_hit_tokens": total(samples, "lmcache_mp_lookup_hit_l1_tokens_total"),
        "shared_hit_tokens": total(samples, "lmcache_mp_lookup_hit_l2_tokens_total"),
        "l1_usage_ratio": total(samples, "lmcache_mp_l1_usage_ratio"),
        "l1_resident_bytes": total(samples, "lmcache_mp_l1_memory_usage_bytes"),
        "l1_write_chunks": l1_writes,
        "l1_read_chunks": l1_reads,
        "l1_evicted_chunks": total(samples, L1_EVICTED_CHUNKS),
        "l2_stored_objects": l2_stored,
        "l2_loaded_objects": l2_loaded,
        "chunk_bytes": chunk_bytes or None,
        "bytes_to_host": in_bytes(l1_writes),
        "bytes_from_host": in_bytes(l1_reads),
        "bytes_to_shared": in_bytes(l2_stored),
        "bytes_from_shared": in_bytes(l2_loaded),
    }

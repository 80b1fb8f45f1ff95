"""Per-tier figures for the ingress `/metrics` and the demo report, from every node's LMCache server.

    from kvmesh.kvstore.tier_metrics import tier_metrics_text, tier_report
    text = tier_metrics_text()        # Prometheus lines, appended to the ingress /metrics body
    report = tier_report()            # one dict summed over nodes, for reports

Both call `kvmesh.kvstore.node_server.tier_status()` (one actor call per node, a few ms each) unless given a
status dict, so they belong on /metrics and reports, never on the routing path.

What the numbers mean: `host`/`shared` hit tokens are LMCache's lookup hits (prompt tokens the node's
host memory, or only the shared tier, could serve when an engine asked). An engine asks LMCache about
the whole prompt, so tokens it also holds in its own cache (`hbm`) can be counted here too; the
delivered split is hbm = engine cached tokens − tokens loaded through the connector (vLLM's
`vllm:external_prefix_cache_hits`), and host/shared divide the loaded part.

Traffic between engines and tiers is counted in LMCache chunks (`kvmesh_tier_chunks_total{direction}`,
LMCache's own counters, which only grow). Bytes (`kvmesh_tier_bytes_total`) appear for a node only when its
figures carry them, i.e. when `tier_summary` was handed a bytes-per-chunk; the node servers hand none (the
engines sharing a node's server may run models of different KV sizes), so kvmesh's own /metrics has no bytes.
"""

from __future__ import annotations

_SUMMED = (
    "lookup_requested_tokens",
    "lookup_hit_tokens",
    "host_hit_tokens",
    "shared_hit_tokens",
    "chunks_to_host",
    "chunks_from_host",
    "chunks_to_shared",
    "chunks_from_shared",
)
# direction -> the `tier_summary` key of its chunk count
_CHUNKS = {
    "to_host": "l1_write_chunks",
    "from_host": "l1_read_chunks",
    "to_shared": "l2_stored_objects",
    "from_shared": "l2_loaded_objects",
}
_BYTES = tuple("bytes_" + direction for direction in _CHUNKS)


def _figure(tiers: dict, key: str) -> float:
    """A summed figure of one node's tiers: `chunks_<direction>` reads its chunk count."""
    if key.startswith("chunks_"):
        key = _CHUNKS[key[len("chunks_") :]]
    return float(tiers.get(key) or 0)


def _status(status: dict | None) -> dict:
    if status is not None:
        return status
    from kvmesh.kvstore.node_server import tier_status

    return tier_status()


def tier_report(status: dict | None = None) -> dict:
    """Totals over nodes + per-node health: {"nodes", "healthy_nodes", "shared_tier_up", <sums>}. The
    `bytes_*` sums cover the nodes whose figures carry bytes; None when none does."""
    status = _status(status)
    sums = {k: 0.0 for k in _SUMMED}
    byte_sums: dict[str, float | None] = {k: None for k in _BYTES}
    shared_up = []
    for node in status.values():
        tiers = node.get("tiers") or {}
        for k in _SUMMED:
            sums[k] += _figure(tiers, k)
        for k in _BYTES:
            if isinstance(tiers.get(k), (int, float)):
                byte_sums[k] = (byte_sums[k] or 0.0) + float(tiers[k])
        if node["health"].get("shared_tier_up") is not None:
            shared_up.append(bool(node["health"]["shared_tier_up"]))
    out: dict[str, float | bool | None] = {**sums, **byte_sums}
    out["nodes"] = len(status)
    out["healthy_nodes"] = sum(1 for n in status.values() if n["health"].get("healthy"))
    out["shared_tier_up"] = all(shared_up) if shared_up else None
    return out


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _known(node: dict) -> dict | None:
    """The node's tier figures, or None when this scrape could not read them (its server did not answer, or
    answered without LMCache's metrics): a counter left out is a gap, one written as 0 reads as a reset."""
    tiers = node.get("tiers") or {}
    health = node.get("health") or {}
    readable = health.get("metrics_ok", health.get("healthy"))
    return tiers if tiers and readable is not False else None


def tier_metrics_text(status: dict | None = None) -> str:
    """Prometheus exposition lines (HELP/TYPE included) for kvmesh's tiers, one label set per node; each
    family's HELP and TYPE right before its own samples, as the text format requires."""
    status = _status(status)
    nodes = sorted(status.items())
    known = [(node, t) for node, s in nodes if (t := _known(s)) is not None]
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

    family(
        "kvmesh_tier_hit_tokens_total",
        "counter",
        "Prompt tokens LMCache could serve, by tier (host = node L1, shared = L2).",
        [
            f'kvmesh_tier_hit_tokens_total{{node="{_esc(node)}",tier="{tier}"}} {float(t.get(key) or 0)}'
            for node, t in known
            for tier, key in (("host", "host_hit_tokens"), ("shared", "shared_hit_tokens"))
        ],
    )
    family(
        "kvmesh_tier_lookup_tokens_total",
        "counter",
        "Prompt tokens engines asked LMCache about.",
        [
            f'kvmesh_tier_lookup_tokens_total{{node="{_esc(node)}"}} {float(t.get("lookup_requested_tokens") or 0)}'
            for node, t in known
        ],
    )
    family(
        "kvmesh_tier_chunks_total",
        "counter",
        "LMCache chunks moved between engines and tiers (to_host/from_host: into/out of the node's L1, "
        "to_shared/from_shared: into/out of L2).",
        [
            f'kvmesh_tier_chunks_total{{node="{_esc(node)}",direction="{direction}"}} {float(t.get(key) or 0)}'
            for node, t in known
            for direction, key in _CHUNKS.items()
        ],
    )
    family(
        "kvmesh_tier_bytes_total",
        "counter",
        "KV bytes moved between engines and tiers: chunks x a bytes-per-chunk (absent where none is given).",
        [
            f'kvmesh_tier_bytes_total{{node="{_esc(node)}",direction="{direction}"}} {float(t["bytes_" + direction])}'
            for node, t in known
            for direction in _CHUNKS
            if isinstance(t.get("bytes_" + direction), (int, float))
        ],
    )
    family(
        "kvmesh_tier_server_healthy",
        "gauge",
        "1 when the node's LMCache server serves and exports metrics.",
        [
            f'kvmesh_tier_server_healthy{{node="{_esc(node)}"}} {1 if s["health"].get("healthy") else 0}'
            for node, s in nodes
        ],
    )
    family(
        "kvmesh_tier_shared_up",
        "gauge",
        "1 when the node's shared tier answers, 0 when down (absent: none).",
        [
            f'kvmesh_tier_shared_up{{node="{_esc(node)}"}} {1 if s["health"]["shared_tier_up"] else 0}'
            for node, s in nodes
            if s["health"].get("shared_tier_up") is not None
        ],
    )
    family(
        "kvmesh_tier_host_usage_ratio",
        "gauge",
        "Fraction of the node's L1 in use.",
        [
            f'kvmesh_tier_host_usage_ratio{{node="{_esc(node)}"}} {float(t.get("l1_usage_ratio") or 0)}'
            for node, t in known
        ],
    )
    return "\n".join(lines) + "\n"

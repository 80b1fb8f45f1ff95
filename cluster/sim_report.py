"""Turning a simulation document into what people read: a fixed-width table and a PNG, each saying what
produced it (the fleet, its tiers, the routers and how requests were sent: `setup`)."""

from __future__ import annotations


def _load(doc: dict) -> str:
    """The load the run offered; a closed loop sends at its own pace, so the trace's figure is not one."""
    cfg = doc["config"]
    if cfg.get("closed_loop_concurrency") is not None:
        return f"n/a (closed loop, concurrency {cfg['closed_loop_concurrency']})"
    load = cfg["load"]
    return "n/a" if load is None else f"{load:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:g}"


def setup(doc: dict) -> str:
    """What the run simulated besides the fleet's size, as `key=value` words: block sizes, the request limit,
    tiers, routers (with their event delay, sync and churn) and how requests were sent."""
    cfg = doc["config"]
    words = [f"block_size={cfg['block_size']}"]
    if cfg.get("tokens_per_block", cfg["block_size"]) != cfg["block_size"]:
        words.append(f"tokens_per_block={cfg['tokens_per_block']}")
    if cfg.get("max_tokens") is not None:
        words.append(f"max_tokens={cfg['max_tokens']}")
    if cfg.get("limit") is not None:
        words.append(f"limit={cfg['limit']}")
    tiers = []
    if cfg.get("host_blocks"):
        tiers.append(f"host={cfg['host_blocks']}/node")
        if cfg.get("replicas_per_node", 1) != 1:
            tiers.append(f"replicas_per_node={cfg['replicas_per_node']}")
    if cfg.get("shared"):
        shared = cfg.get("shared_blocks")
        tiers.append(f"shared={'unbounded' if shared is None else shared}")
    if tiers:
        tiers.append(f"store_at={cfg.get('tier_store_at', 'routed')}")
        if cfg.get("tier_chunk_blocks", 1) != 1:
            tiers.append(f"chunk_blocks={cfg['tier_chunk_blocks']}")
    words.append("tiers=" + (",".join(tiers) if tiers else "none"))
    words.append(f"routers={cfg.get('routers', 1)}")
    if cfg.get("event_delay_s"):
        words.append(f"event_delay_ms={_ms(cfg['event_delay_s'])}")
    if cfg.get("routers", 1) > 1:
        words.append(f"router_sync={'on' if cfg.get('router_sync', True) else 'off'}")
    if cfg.get("churn_every_s") is not None:
        words.append(f"churn_every_s={cfg['churn_every_s']:g}")
    send = cfg.get("send")
    if send:
        words.append("send=" + send.replace(", ", ",").replace(" ", "-"))
    return " ".join(words)


# the merged-LRU bounds a policy's hit rate can be divided by, most tiers first, with the table's column label
_REFERENCES = (
    ("merged_lru_with_shared", "/merged+shared"),
    ("merged_lru_with_host", "/merged+host"),
    ("merged_lru", "/merged"),
)


def merged_reference(bounds: dict) -> tuple[str, str, float]:
    """(bound key, column label, value) a policy's hit rate is divided by: one LRU of every cache tier the run
    had, since the policy's hit rate counts hits in each (against HBM alone it read 2-5x "the bound" with host
    tiers, 8x with a shared tier): the fleet's HBM (`/merged`), plus its host tiers (`/merged+host`), plus the
    shared tier, with the host tiers when given (`/merged+shared`). 0.0 when the document has none."""
    for key, label in _REFERENCES:
        if bounds.get(key) is not None:
            return key, label, bounds[key]
    return "merged_lru", "/merged", 0.0


def format_table(doc: dict) -> str:
    b = doc["bounds"]
    _, label, ref = merged_reference(b)
    width = len(label)
    lines = [
        f"trace={doc['trace']} requests={doc['requests']} replicas={doc['replicas']} "
        f"capacity_blocks={doc['capacity_blocks']} load={_load(doc)}",
        f"setup: {setup(doc)}",
        "bounds: " + "  ".join(f"{k}={v:.4f}" for k, v in b.items()),
    ]
    bal = doc.get("balance_bounded")
    if bal:
        lines.append(
            f"balance-bounded bound (unbounded caches, prefill max/mean <= {bal['max_imbalance']:.2f}): "
            f"balance_bounded={bal['hit_rate']:.4f} (max/mean reached {bal['imbalance']:.3f})"
        )
    lines += [
        f"{'policy':<20} {'hit_tok':>7} {'hit_req':>7} {label:>{width}} {'imbal':>6} {'p50_s':>8} {'p90_s':>8} "
        f"{'p99_s':>8} {'util':>5} {'tok/s':>9} {'cost_$':>9}",
    ]
    for name, m in doc["policies"].items():
        ratio = f"{m['hit_rate_tokens'] / ref:.3f}" if ref else "n/a"
        lines.append(
            f"{name:<20} {m['hit_rate_tokens']:>7.4f} {m['hit_rate_requests']:>7.4f} {ratio:>{width}} "
            f"{m['imbalance']:>6.3f} {m['ttft_p50_s']:>8.3f} {m['ttft_p90_s']:>8.3f} {m['ttft_p99_s']:>8.3f} "
            f"{m['utilization']:>5.2f} {m['throughput_tokens_s']:>9.0f} {m['blended_cost']:>9.2f}"
        )
    return "\n".join(lines)


_LINE_STYLES = {
    "global_infinite": ("tab:red", "--"),
    "merged_lru": ("tab:blue", "-."),
    "merged_lru_with_host": ("tab:purple", ":"),
    "merged_lru_with_shared": ("tab:brown", ":"),
}


def bound_lines(bounds: dict) -> list[tuple[str, float, str, str]]:
    """(legend text, value, colour, line style) of each bound the plot draws; the one the table's ratio column
    divides by (`merged_reference`) says so with the column's label."""
    ref_key, label, _ = merged_reference(bounds)
    lines = []
    for k, v in bounds.items():
        c, ls = _LINE_STYLES.get(k, ("black", ":"))
        lines.append((f"{k} {v:.3f}" + (f" ({label} reference)" if k == ref_key else ""), v, c, ls))
    return lines


def plot(doc: dict, path: str) -> None:
    """Hit rate (with the bounds as lines) and p90 TTFT per policy, side by side, under a title saying what was
    simulated (`setup`); the PNG is written whole or not at all (`whole_file.atomic_write`)."""
    import matplotlib

    from kvmesh.cluster.whole_file import atomic_write

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["policies"])
    hits = [doc["policies"][n]["hit_rate_tokens"] for n in names]
    p90 = [doc["policies"][n]["ttft_p90_s"] for n in names]
    colors = ["tab:green" if n == "kvmesh" else "tab:gray" for n in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    a1.bar(names, hits, color=colors)
    for text, v, c, ls in bound_lines(doc["bounds"]):
        a1.axhline(v, color=c, linestyle=ls, label=text)
    if doc.get("balance_bounded"):
        v = doc["balance_bounded"]["hit_rate"]
        a1.axhline(v, color="tab:orange", linestyle="--", label=f"balance_bounded {v:.3f}")
    a1.set_ylabel("token-weighted hit rate")
    a1.set_title(f"{doc['trace']}: {doc['replicas']} replicas x {doc['capacity_blocks']} blocks")
    fig.suptitle(setup(doc), fontsize=8)
    a1.legend(fontsize=8, loc="upper right")
    a2.bar(names, p90, color=colors)
    a2.set_ylabel("p90 TTFT (s)")
    a2.set_yscale("log")
    a2.set_title(f"p90 TTFT at load {_load(doc)}")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=110)
    finally:
        plt.close(fig)

"""Turning a simulation document into what people read: a fixed-width table and a PNG."""

from __future__ import annotations

import os


def _load(doc: dict) -> str:
    load = doc["config"]["load"]
    return "n/a" if load is None else f"{load:.2f}"


def format_table(doc: dict) -> str:
    b = doc["bounds"]
    ref = b.get("merged_lru") or 0.0
    lines = [
        f"trace={doc['trace']} requests={doc['requests']} replicas={doc['replicas']} "
        f"capacity_blocks={doc['capacity_blocks']} load={_load(doc)}",
        "bounds: " + "  ".join(f"{k}={v:.4f}" for k, v in b.items()),
    ]
    bal = doc.get("balance_bounded")
    if bal:
        lines.append(
            f"balance-bounded bound (unbounded caches, prefill max/mean <= {bal['max_imbalance']:.2f}): "
            f"balance_bounded={bal['hit_rate']:.4f} (max/mean reached {bal['imbalance']:.3f})"
        )
    lines += [
        f"{'policy':<20} {'hit_tok':>7} {'hit_req':>7} {'/merged':>7} {'imbal':>6} {'p50_s':>8} {'p90_s':>8} "
        f"{'p99_s':>8} {'util':>5} {'tok/s':>9} {'cost_$':>9}",
    ]
    for name, m in doc["policies"].items():
        ratio = f"{m['hit_rate_tokens'] / ref:.3f}" if ref else "n/a"
        lines.append(
            f"{name:<20} {m['hit_rate_tokens']:>7.4f} {m['hit_rate_requests']:>7.4f} {ratio:>7} "
            f"{m['imbalance']:>6.3f} {m['ttft_p50_s']:>8.3f} {m['ttft_p90_s']:>8.3f} {m['ttft_p99_s']:>8.3f} "
            f"{m['utilization']:>5.2f} {m['throughput_tokens_s']:>9.0f} {m['blended_cost']:>9.2f}"
        )
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    """Hit rate (with the bounds as lines) and p90 TTFT per policy, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["policies"])
    hits = [doc["policies"][n]["hit_rate_tokens"] for n in names]
    p90 = [doc["policies"][n]["ttft_p90_s"] for n in names]
    colors = ["tab:green" if n == "kvmesh" else "tab:gray" for n in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    a1.bar(names, hits, color=colors)
    styles = {
        "global_infinite": ("tab:red", "--"),
        "merged_lru": ("tab:blue", "-."),
        "merged_lru_with_host": ("tab:purple", ":"),
    }
    for k, v in doc["bounds"].items():
        c, ls = styles.get(k, ("black", ":"))
        a1.axhline(v, color=c, linestyle=ls, label=f"{k} {v:.3f}")
    if doc.get("balance_bounded"):
        v = doc["balance_bounded"]["hit_rate"]
        a1.axhline(v, color="tab:orange", linestyle="--", label=f"balance_bounded {v:.3f}")
    a1.set_ylabel("token-weighted hit rate")
    a1.set_title(f"{doc['trace']}: {doc['replicas']} replicas x {doc['capacity_blocks']} blocks")
    a1.legend(fontsize=8, loc="upper right")
    a2.bar(names, p90, color=colors)
    a2.set_ylabel("p90 TTFT (s)")
    a2.set_yscale("log")
    a2.set_title(f"p90 TTFT at load {_load(doc)}")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

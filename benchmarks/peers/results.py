"""Turn one run's measurements into comparable rows, targets, a table, JSON and a PNG. Pure (no I/O
except the writers), so it is unit-tested without any server.

A row is one (workload, prompt form, setup). Per-worker figures come from each vLLM server's
/metrics deltas for peers (they do not say where they sent a request) and from kvmesh's own replica
header for kvmesh; both are reduced to the same max/mean numbers here. "Prefill tokens" are the
prompt tokens a worker actually computed (prompt - prefix-cache hits): the work the router placed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

KVMESH = "kvmesh"
HIT_MARGIN = 0.01  # kvmesh hit rate >= best peer - 0.01
BOUND_SHARE = 0.95  # kvmesh hit rate >= 0.95 x infinite-cache bound
MAX_PREFILL_IMBALANCE = 1.25  # prefill tokens per worker, max / mean
TTFT_RATIO = 1.2  # kvmesh TTFT p50 <= 1.2 x the best peer's at equal hit rate (docs/peers.md)
TTFT_CHECK = f"TTFT p50 <= {TTFT_RATIO} x best peer at equal hit"
PEERS_CHECK = "every peer answered every request"


def max_over_mean(values: list[float]) -> float | None:
    """Imbalance of a per-worker quantity; idle workers count (a router that leaves workers idle is
    exactly what this must expose). None when nothing was done at all."""
    if not values:
        return None
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else None


def workers_from_metric_deltas(deltas: list[dict]) -> list[dict]:
    """Per worker: requests, prompt tokens, cached tokens, prefill tokens from /metrics deltas
    (`metrics.delta` output: keys requests, prompt_tokens, prefix_hits)."""
    out = []
    for d in deltas:
        prompt, hits = d.get("prompt_tokens", 0), d.get("prefix_hits", 0)
        out.append(
            {
                "requests": d.get("requests", 0),
                "prompt_tokens": prompt,
                "cached_tokens": hits,
                "prefill_tokens": max(0, prompt - hits),
            }
        )
    return out


def workers_from_replay(per_replica: dict, n_workers: int) -> list[dict]:
    """Per worker from kvmesh's replay summary (`x-kvmesh-replica`), padded with idle workers."""
    out = [
        {
            "requests": r["requests"],
            "prompt_tokens": r["prompt_tokens"],
            "cached_tokens": r["cached_tokens"],
            "prefill_tokens": r["prompt_tokens"] - r["cached_tokens"],
        }
        for r in per_replica.values()
    ]
    out += [
        {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0}
        for _ in range(max(0, n_workers - len(out)))
    ]
    return out


def make_row(
    workload: str, form: str, setup: str, summary: dict, workers: list[dict], bound: float | None, note: str = ""
) -> dict:
    """One comparable row. `summary` is kvmesh.deployments.replay.ReplayReport.summary()."""
    hit = summary.get("hit_rate_tokens")
    return {
        "workload": workload,
        "form": form,
        "setup": setup,
        "note": note,
        "requests": summary.get("requests", 0),
        "errors": summary.get("errors", 0),
        "error_samples": summary.get("error_samples", []),
        "hit_rate_tokens": hit,
        "hit_rate_requests": summary.get("hit_rate_requests"),
        "prompt_tokens": summary.get("prompt_tokens"),
        "uncached_prompt_tokens": summary.get("uncached_prompt_tokens"),
        "bound_infinite": bound,
        "hit_over_bound": (hit / bound) if (hit is not None and bound) else None,
        "ttft_p50_s": summary.get("ttft_p50_s"),
        "ttft_p90_s": summary.get("ttft_p90_s"),
        "wall_s": summary.get("wall_s"),
        "requests_per_worker": [w["requests"] for w in workers],
        "prefill_per_worker": [w["prefill_tokens"] for w in workers],
        "requests_max_over_mean": max_over_mean([w["requests"] for w in workers]),
        "prefill_max_over_mean": max_over_mean([w["prefill_tokens"] for w in workers]),
    }


def ttft_peer(kvmesh_hit: float | None, peers: list[dict]) -> dict | None:
    """The best peer at equal hit rate: among the peers at kvmesh's hit rate (hit >= kvmesh's - 0.01, as the
    hit target counts a peer level with kvmesh) the one with the lowest TTFT p50; None when none is there."""
    if kvmesh_hit is None:
        return None
    level = [r for r in peers if r["ttft_p50_s"] is not None and r["hit_rate_tokens"] >= kvmesh_hit - HIT_MARGIN]
    return min(level, key=lambda r: r["ttft_p50_s"], default=None)


def failed_peers(group: list[dict], form: str, unsupported: dict[str, tuple[str, ...]]) -> list[dict]:
    """The peer rows of one (workload, form) that did not answer every request (an error, or no request
    answered at all), but for a setup declared unable to take this prompt form (`unsupported`)."""
    return [
        r
        for r in group
        if r["setup"] != KVMESH
        and form not in unsupported.get(r["setup"], ())
        and (r["errors"] or not r["requests"] or r["hit_rate_tokens"] is None)
    ]


def check_targets(rows: list[dict], unsupported: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    """The live targets per (workload, form): kvmesh hit >= best peer - 0.01, >= 0.95 x bound,
    prefill max/mean <= 1.25, zero errors, TTFT p50 <= 1.2 x the best peer's at equal hit rate
    (`ttft_peer`; met when no peer reaches kvmesh's hit rate: there is none to compare with at equal
    hit rate), and every peer answered every request: a peer that failed requests is not a baseline to
    compare with (all failed: it has no hit rate and drops out of 'best peer'; some failed: its hit rate
    is that of the requests it answered), so the verdict misses and names it (`peers_failed`). Exempt only
    a setup declared unable to take the prompt form, `unsupported` (setup name -> forms; default
    `setups.UNSUPPORTED_FORMS`: sglang-router's HTTP 422 on token ids); such a peer is left out of the
    comparison."""
    if unsupported is None:
        from kvmesh.benchmarks.peers.setups import UNSUPPORTED_FORMS

        unsupported = UNSUPPORTED_FORMS
    verdicts = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["form"]), []).append(r)
    for (workload, form), group in groups.items():
        ours = [r for r in group if r["setup"] == KVMESH]
        peers = [
            r
            for r in group
            if r["setup"] != KVMESH and r["hit_rate_tokens"] is not None and r["errors"] < r["requests"]
        ]
        if not ours:
            continue
        k = ours[0]
        failed = failed_peers(group, form, unsupported)
        best = max(peers, key=lambda r: r["hit_rate_tokens"], default=None)
        hit = k["hit_rate_tokens"]
        level = ttft_peer(hit, peers)
        p50, peer_p50 = k["ttft_p50_s"], level["ttft_p50_s"] if level else None
        ratio = p50 / peer_p50 if p50 is not None and peer_p50 else None
        if hit is None or p50 is None or not peers:
            ttft_ok = None  # nothing to judge: no kvmesh figure, or no peer answered
        elif level is None:
            ttft_ok = True  # every peer is more than 0.01 below kvmesh's hit rate
        else:
            ttft_ok = ratio is not None and ratio <= TTFT_RATIO
        checks = {
            "hit >= best peer - 0.01": None
            if best is None or hit is None
            else hit >= best["hit_rate_tokens"] - HIT_MARGIN,
            "hit >= 0.95 x bound": None
            if hit is None or not k["bound_infinite"]
            else hit >= BOUND_SHARE * k["bound_infinite"],
            "prefill max/mean <= 1.25": None
            if k["prefill_max_over_mean"] is None
            else k["prefill_max_over_mean"] <= MAX_PREFILL_IMBALANCE,
            "zero errors": k["errors"] == 0,
            TTFT_CHECK: ttft_ok,
            PEERS_CHECK: not failed,
        }
        verdicts.append(
            {
                "workload": workload,
                "form": form,
                "best_peer": best["setup"] if best else None,
                "best_peer_hit": best["hit_rate_tokens"] if best else None,
                "kvmesh_hit": hit,
                "ttft_peer": level["setup"] if level else None,
                "ttft_peer_hit": level["hit_rate_tokens"] if level else None,
                "ttft_peer_p50_s": peer_p50,
                "kvmesh_ttft_p50_s": p50,
                "ttft_ratio": ratio,
                "peers_failed": [f"{r['setup']} ({r['errors']}/{r['requests']} failed)" for r in failed],
                "checks": checks,
                "pass": all(v is True for v in checks.values()),
            }
        )
    return verdicts


def merge_rows(*runs: list[dict]) -> list[dict]:
    """Rows of several runs; a later run's row replaces an earlier one for the same (workload, form,
    setup) -- e.g. re-running one setup after a fix without repeating the whole comparison."""
    merged: dict[tuple, dict] = {}
    for rows in runs:
        for r in rows:
            merged[(r["workload"], r["form"], r["setup"])] = r
    return list(merged.values())


def _fmt(v, kind: str) -> str:
    if v is None:
        return "n/a"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "ms":
        return f"{1000 * v:.0f}"
    if kind == "x":
        return f"{v:.2f}"
    if kind == "list":
        return "/".join(str(x) for x in v)
    return f"{v:,}" if isinstance(v, int) else str(v)


COLUMNS = [
    ("workload", "workload", "s"),
    ("form", "form", "s"),
    ("setup", "setup", "s"),
    ("hit", "hit_rate_tokens", "pct"),
    ("/bound", "hit_over_bound", "x"),
    ("uncached", "uncached_prompt_tokens", "int"),
    ("req/worker", "requests_per_worker", "list"),
    ("req max/mean", "requests_max_over_mean", "x"),
    ("prefill/worker", "prefill_per_worker", "list"),
    ("prefill max/mean", "prefill_max_over_mean", "x"),
    ("TTFT p50 ms", "ttft_p50_s", "ms"),
    ("p90 ms", "ttft_p90_s", "ms"),
    ("errors", "errors", "int"),
]


def format_table(rows: list[dict]) -> str:
    cells = [[h for h, _, _ in COLUMNS]] + [[_fmt(r.get(k), kind) for _, k, kind in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_verdicts(verdicts: list[dict]) -> str:
    out = []
    for v in verdicts:
        checks = ", ".join(
            f"{name}: {'PASS' if ok else ('n/a' if ok is None else 'MISS')}" for name, ok in v["checks"].items()
        )
        if v.get("ttft_peer"):
            ttft = (
                f"TTFT p50 kvmesh {_fmt(v['kvmesh_ttft_p50_s'], 'ms')} ms vs {v['ttft_peer']} "
                f"{_fmt(v['ttft_peer_p50_s'], 'ms')} ms at {_fmt(v['ttft_peer_hit'], 'pct')} = "
                f"{_fmt(v['ttft_ratio'], 'x')}x"
            )
        else:
            ttft = f"TTFT p50 kvmesh {_fmt(v.get('kvmesh_ttft_p50_s'), 'ms')} ms, no peer at its hit rate"
        failed = (
            f"; peers that did not answer every request: {', '.join(v['peers_failed'])}"
            if v.get("peers_failed")
            else ""
        )
        out.append(
            f"{'PASS' if v['pass'] else 'MISS'}  {v['workload']}/{v['form']}: kvmesh "
            f"{_fmt(v['kvmesh_hit'], 'pct')} vs best peer {v['best_peer']} {_fmt(v['best_peer_hit'], 'pct')}"
            f"; {ttft} -- {checks}{failed}"
        )
    return "\n".join(out)


def write_json(path: Path, meta: dict, rows: list[dict], verdicts: list[dict], extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows, "targets": verdicts, **(extra or {})}, indent=2))


def write_png(path: Path, rows: list[dict]) -> None:
    """Per (workload, form): hit rate and prefill max/mean per setup, bound drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["form"]), []).append(r)
    n = max(1, len(groups))
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n, 6.5), squeeze=False)
    for col, ((workload, form), group) in enumerate(groups.items()):
        names = [r["setup"] for r in group]
        colors = ["tab:green" if s == KVMESH else "tab:gray" for s in names]
        ax = axes[0][col]
        ax.bar(range(len(group)), [r["hit_rate_tokens"] or 0 for r in group], color=colors)
        bound = group[0]["bound_infinite"]
        if bound:
            ax.axhline(bound, color="tab:red", ls="--", lw=1, label="infinite-cache bound")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"{workload} / {form}", fontsize=9)
        ax.set_ylabel("token-weighted hit rate")
        ax.set_ylim(0, 1)
        ax.set_xticks(range(len(group)), names, rotation=40, ha="right", fontsize=7)
        ax = axes[1][col]
        ax.bar(range(len(group)), [r["prefill_max_over_mean"] or 0 for r in group], color=colors)
        ax.axhline(MAX_PREFILL_IMBALANCE, color="tab:red", ls="--", lw=1)
        ax.set_ylabel("prefill tokens/worker max/mean")
        ax.set_xticks(range(len(group)), names, rotation=40, ha="right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

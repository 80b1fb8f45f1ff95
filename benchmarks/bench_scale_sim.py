"""The fleet at internet scale, simulated: R routers, each with its own view, seeing engine events and
each other's decisions d late (cluster/multi_router.py).

Grid: R in {1, 4, 16} x d in {0, 10 ms, 100 ms, 1 s} x router sync on/off, 256 replicas x 4000 HBM
blocks, load 0.8, kvmesh, on the bundled traces (conversation, synthetic) and a generated multi-tenant
chat slice (`kvmesh trace synth` shape: 20 tenants x 10 system prompts, 8 turns per user; a user's
next turn is sent no earlier than its previous reply's end, `ClosedLoop.timed`). Per cell:
token hit rate, imbalance (per-replica prefill max/mean), p90 TTFT.
Target: with sync, hit rate >= 0.98 x the single router's at the same d, for d = 100 ms (every R).
Prints where it breaks (the first d at which a synced R misses 0.98). Writes the table as JSON and the
plot to BENCH_OUT (default out/): scale_sim.json, scale_sim.png. BENCH_SCALE_CHAT_USERS sets the
generated slice's users per system prompt (default 12: 19,200 requests), BENCH_SCALE_LIMIT the bundled
traces' first N requests (default all). Exit 1 on a miss.
"""

from __future__ import annotations

import json
import os
import time

from kvmesh.benchmarks.targets import Targets
from kvmesh.cluster.multi_router import RouterSetup, simulate_routers
from kvmesh.cluster.simulator import ClosedLoop, SimConfig
from kvmesh.cluster.trace import Trace, TraceRequest, load_trace, users_meta
from kvmesh.cluster.workloads import ChatSpec, synth_chat
from kvmesh.policies.registry import make_policy

REPLICAS = 256
CAPACITY = 4000
LOAD = 0.8
ROUTERS = (1, 4, 16)
DELAYS_S = (0.0, 0.010, 0.100, 1.0)
TARGET_RATIO = 0.98
TARGET_DELAY_S = 0.100


def chat_slice(users: int) -> Trace:
    """The generated multi-tenant workload's shape at `users` users per system prompt."""
    spec = ChatSpec(tenants=20, groups=10, users=users, turns=8, start_spread_ms=users * 5760)
    records = synth_chat(spec)
    return Trace("chat", [TraceRequest.from_record(r) for r in records], 512, users_meta([r["user"] for r in records]))


def grid(trace: Trace) -> list[dict]:
    cfg = SimConfig(REPLICAS, CAPACITY, load=LOAD)
    client = ClosedLoop.replying(trace, cfg)  # the chat slice's turns after their replies
    rows = []
    for d in DELAYS_S:
        for r in ROUTERS:
            for sync in (True, False) if r > 1 else (True,):
                t0 = time.process_time()
                m = simulate_routers(trace, cfg, lambda: make_policy("kvmesh"), RouterSetup(r, d, sync), client=client)
                rows.append(
                    {
                        "trace": trace.name,
                        "routers": r,
                        "delay_s": d,
                        "sync": sync,
                        "hit_rate": m["hit_rate_tokens"],
                        "imbalance": m["imbalance"],
                        "ttft_p90_s": m["ttft_p90_s"],
                        "cpu_s": time.process_time() - t0,
                    }
                )
                x = rows[-1]
                print(
                    f"  {trace.name:<13} R={r:<3} d={d * 1000:>5.0f} ms sync={'on ' if sync else 'off'} "
                    f"hit {x['hit_rate']:.4f}  imbalance {x['imbalance']:.3f}  p90 TTFT {x['ttft_p90_s']:.3f} s"
                    f"  ({x['cpu_s']:.0f} s CPU)",
                    flush=True,
                )
    return rows


def judge(rows: list[dict], targets: Targets) -> None:
    by = {(x["trace"], x["routers"], x["delay_s"], x["sync"]): x for x in rows}
    for name in dict.fromkeys(x["trace"] for x in rows):
        for r in ROUTERS[1:]:
            broke = None
            for d in DELAYS_S:
                ratio = by[(name, r, d, True)]["hit_rate"] / max(by[(name, 1, d, True)]["hit_rate"], 1e-12)
                if broke is None and ratio < TARGET_RATIO:
                    broke = d
                if d == TARGET_DELAY_S:
                    off = by[(name, r, d, False)]["hit_rate"] / max(by[(name, 1, d, True)]["hit_rate"], 1e-12)
                    ok = ratio >= TARGET_RATIO
                    print(
                        f"  {name:<13} R={r:<3} d=100 ms: synced {ratio:.4f} x the single router's hit rate "
                        f"(without sync {off:.4f}); target >= {TARGET_RATIO}: "
                        f"{targets.verdict(f'{name} R={r} synced hit >= 0.98 x single router at 100 ms', ok)}"
                    )
            where = "holds at every d up to 1 s" if broke is None else f"breaks at d = {broke * 1000:.0f} ms"
            print(f"  {name:<13} R={r:<3} with sync: {where}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(x["trace"] for x in rows))
    metrics = (("hit_rate", "token hit rate"), ("imbalance", "prefill max/mean"), ("ttft_p90_s", "p90 TTFT (s)"))
    fig, axes = plt.subplots(len(names), 3, figsize=(15, 3.6 * len(names)), squeeze=False)
    xs = [max(d * 1000, 1.0) for d in DELAYS_S]  # d = 0 drawn at 1 ms on the log axis
    for i, name in enumerate(names):
        for k, (key, label) in enumerate(metrics):
            ax = axes[i][k]
            for r, color in zip(ROUTERS, ("black", "tab:blue", "tab:red")):
                for sync in (True, False) if r > 1 else (True,):
                    got = {
                        x["delay_s"]: x[key] for x in rows if (x["trace"], x["routers"], x["sync"]) == (name, r, sync)
                    }
                    ax.plot(
                        [x for x, d in zip(xs, DELAYS_S) if d in got],
                        [got[d] for d in DELAYS_S if d in got],
                        color=color,
                        ls="-" if sync else "--",
                        marker="o",
                        label=f"R={r}" + ("" if r == 1 else " sync" if sync else " no sync"),
                    )
            ax.set_xscale("log")
            ax.set_xlabel("event delay d (ms; 0 drawn at 1)")
            ax.set_title(f"{name}: {label}")
            if i == 0 and k == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"kvmesh, {REPLICAS} replicas x {CAPACITY} blocks, load {LOAD}: R routers, event delay d")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    out_dir = os.environ.get("BENCH_OUT", "out")
    targets = Targets()
    limit = int(os.environ.get("BENCH_SCALE_LIMIT", "0")) or None
    users = int(os.environ.get("BENCH_SCALE_CHAT_USERS", "12"))
    traces = [load_trace("conversation", limit=limit), load_trace("synthetic", limit=limit), chat_slice(users)]
    print(f"R routers x event delay d, {REPLICAS} replicas x {CAPACITY} blocks, load {LOAD}, kvmesh")
    print("requests spread over routers round robin; the chat slice's turns each after the previous reply")
    rows = []
    for trace in traces:
        print(f" {trace.name}: {len(trace)} requests", flush=True)
        rows += grid(trace)
    judge(rows, targets)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "scale_sim.json"), "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
    plot(rows, os.path.join(out_dir, "scale_sim.png"))
    print(f"  wrote {out_dir}/scale_sim.json, {out_dir}/scale_sim.png")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

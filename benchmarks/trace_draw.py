"""One robustness draw, kvmesh live and simulated in the same send order, decision by decision.

    python -m kvmesh.benchmarks.trace_draw SEED [--tier] [--json out/trace-SEED.json]

Why: when the live router and the simulator end a draw differently (hit rate, balance), the figures do
not say why. Both record what ranking saw per replica at every placement (`cluster/decision_trace.py`);
this runs the draw once each way (a fresh local app, as the live robustness bench does) and prints the
first request they place differently, with each side's view of the fleet then and the order the two
routed requests in. A run takes 2-4 minutes here; `--tier` runs the engines with LMCache and simulates
a shared tier.
"""

from __future__ import annotations

import argparse
import json
import os

from kvmesh.cluster.decision_trace import format_divergence


def trace_draw(seed: int, tier: bool = False, log=print) -> dict:
    """The draw's live run and its simulation (`robust_live.run_live`, `simulate_in_send_order`), their
    comparison, with the first placement they make differently (`first_divergence`, None when none)."""
    from kvmesh.benchmarks.robust_live import compare, run_live, simulate_in_send_order
    from kvmesh.cluster.workload_family import draw, records

    d = draw(seed)
    recs = records(d)
    n = d.live_replicas
    log(f"draw {seed}: {len(recs)} requests, {n} replicas")
    live = run_live(recs, d, n, "kvmesh", log, tier=tier)
    sim = simulate_in_send_order(recs, d, n, "kvmesh", shared=tier)
    return {"seed": seed, "tier": tier, "live": live, "sim": sim, "sim_vs_live": compare(live, sim)}


def report(result: dict) -> str:
    live, sim, c = result["live"], result["sim"], result["sim_vs_live"]
    lines = [
        f"live: hit {live['hit']:.3f}, prefill max/mean {live['prefill_max_over_mean']:.2f}, requests per replica "
        f"{live['requests']}, TTFT p50 {live['ttft_p50_s'] * 1e3:.0f} ms",
        f"simulated: hit {sim['hit']:.3f}, prefill max/mean {sim['prefill_max_over_mean']:.2f}, requests per "
        f"replica {sim['requests']}, TTFT p50 {sim['ttft_p50_s'] * 1e3:.0f} ms",
        f"apart by: hit {c['hit']:.3f}, max/mean {c['prefill_max_over_mean']:.2f}, requests {c['requests']:.2f}; "
        f"placed alike {c.get('placed_alike', 0.0):.0%}",
    ]
    div = c["first_divergence"]
    return "\n".join(lines + (format_divergence(div) if div else ["every request placed alike"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed", help="a robustness draw's seed (benchmarks/robust_seeds.json has the sets)")
    parser.add_argument("--tier", action="store_true", help="engines with LMCache, simulated with a shared tier")
    parser.add_argument("--json", default=None, help="where to save both traces (default out/trace-SEED.json)")
    args = parser.parse_args(argv)
    try:
        seed = int(args.seed)
    except ValueError:
        parser.exit(2, f"trace_draw: SEED must be an integer, got {args.seed!r}\n")
    result = trace_draw(seed, args.tier)
    print(report(result))
    path = args.json or os.path.join("out", f"trace-{seed}{'-tier' if args.tier else ''}.json")
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(f"saved: {path}")
    return 0


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

"""One robustness draw, kvmesh live and simulated in the same send order, decision by decision.

    python -m kvmesh.benchmarks.trace_draw SEED [--tier] [--family family|wide] [--json out/trace-SEED.json]

Why: when the live router and the simulator end a draw differently (hit rate, balance), the figures do
not say why. Both record what ranking saw per replica at every placement (`cluster/decision_trace.py`);
this runs the draw once each way (a fresh local app, as the live robustness bench does) and prints the
first request they place differently, with each side's view of the fleet then and the order the two
routed requests in. A run takes 2-4 minutes here; `--tier` runs the engines with LMCache and simulates
a shared tier. The seed's set in `benchmarks/robust_seeds.json` decides the workload family (tune and
eval: `cluster/workload_family.py`; wide_eval: `cluster/workload_wide.py`); a seed in no set needs
`--family`.
"""

from __future__ import annotations

import argparse
import json
import os

from kvmesh.cluster.decision_trace import format_divergence

SET_FAMILY = {"tune": "family", "eval": "family", "wide_eval": "wide"}  # seed set -> `robust_live.FAMILIES` key


def seed_family(seed: int, family: str | None = None) -> str:
    """The workload family (a key of `robust_live.FAMILIES`) a seed's draw comes from: the family of the
    robust_seeds.json set holding it, or `family` for a seed in no set. ValueError, with a one-line reason,
    for a seed in no set without `family`, or a `family` that contradicts the seed's set."""
    from kvmesh.benchmarks.robust_live import FAMILIES

    if family is not None and family not in FAMILIES:
        raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, got {family!r}")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "robust_seeds.json"), encoding="utf-8") as fh:
        sets = json.load(fh)
    found = {fam for name, fam in SET_FAMILY.items() if seed in sets.get(name, [])}
    if not found:
        if family is None:
            raise ValueError(f"seed {seed} is in no set of benchmarks/robust_seeds.json; name its --family")
        return family
    [in_set] = found
    if family is not None and family != in_set:
        raise ValueError(f"seed {seed} is a {in_set!r} draw in benchmarks/robust_seeds.json, not {family!r}")
    return in_set


def trace_draw(seed: int, tier: bool = False, log=print, family: str | None = None) -> dict:
    """The draw's live run and its simulation (`robust_live.run_live`, `simulate_in_send_order`), their
    comparison, with the first placement they make differently (`first_divergence`, None when none). The
    draw is of the seed's family (`seed_family`)."""
    from kvmesh.benchmarks.robust_live import FAMILIES, compare, live_replicas, run_live, simulate_in_send_order

    fam = seed_family(seed, family)
    d = FAMILIES[fam].draw(seed)
    recs = d.records()
    n = live_replicas(d)
    log(f"draw {seed} ({fam}): {len(recs)} requests, {n} replicas")
    live = run_live(recs, d, n, "kvmesh", log, tier=tier)
    sim = simulate_in_send_order(recs, d, n, "kvmesh", shared=tier)
    return {"seed": seed, "family": fam, "tier": tier, "live": live, "sim": sim, "sim_vs_live": compare(live, sim)}


def report(result: dict) -> str:
    """The live run, its simulation and how far apart they are; a missing figure (a live run none of whose
    requests succeeded) prints as "-"."""
    from kvmesh.benchmarks.robust_live import fmt_figure as f

    live, sim, c = result["live"], result["sim"], result["sim_vs_live"]
    lines = [
        f"live: hit {f(live['hit'], '.3f')}, prefill max/mean {f(live['prefill_max_over_mean'], '.2f')}, "
        f"requests per replica {live['requests']}, TTFT p50 {f(live['ttft_p50_s'], '.0f', 1e3)} ms",
        f"simulated: hit {f(sim['hit'], '.3f')}, prefill max/mean {f(sim['prefill_max_over_mean'], '.2f')}, "
        f"requests per replica {sim['requests']}, TTFT p50 {f(sim['ttft_p50_s'], '.0f', 1e3)} ms",
        f"apart by: hit {f(c['hit'], '.3f')}, max/mean {f(c['prefill_max_over_mean'], '.2f')}, requests "
        f"{f(c['requests'], '.2f')}; placed alike {f(c.get('placed_alike'), '.0%')}",
    ]
    div = c["first_divergence"]
    return "\n".join(lines + (format_divergence(div) if div else ["every request placed alike"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed", help="a robustness draw's seed (benchmarks/robust_seeds.json has the sets)")
    parser.add_argument("--tier", action="store_true", help="engines with LMCache, simulated with a shared tier")
    parser.add_argument(
        "--family",
        default=None,
        help="the workload family of a seed in no set of robust_seeds.json: family or wide (default: the seed's set)",
    )
    parser.add_argument("--json", default=None, help="where to save both traces (default out/trace-SEED.json)")
    args = parser.parse_args(argv)
    try:
        seed = int(args.seed)
    except ValueError:
        parser.exit(2, f"trace_draw: SEED must be an integer, got {args.seed!r}\n")
    try:
        family = seed_family(seed, args.family)
    except ValueError as exc:
        parser.exit(2, f"trace_draw: {exc}\n")
    result = trace_draw(seed, args.tier, family=family)
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

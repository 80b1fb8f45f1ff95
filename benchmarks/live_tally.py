"""The saved live robustness runs, tallied: per live check, on how many draws it held.

    python -m kvmesh.benchmarks.live_tally docs/results/robust-live-tier*.json
    python -m kvmesh.benchmarks.live_tally --simulate docs/results/robust-live-tier*.json

Why: the evaluation draws run live a slice at a time (`ROBUST_LIVE_FROM`), each slice saved as its own
file, so no single bench run prints the whole picture. This reads the saved rows (a later file's row for
a seed replaces an earlier one's), re-judges each with `robust_live.live_checks` (so rows saved before a
check existed are judged by what they hold), and prints per check the draws it held on and the ones it
missed, the draws that meet every live target without a tier, those where the simulator is within every
sim-vs-live tolerance, the LMCache arm's hit rate against the infinite-cache bound, and the median TTFT
p50 ratio to round robin per arm. With `--simulate`, every row's shared-tier arms are simulated again with
the code now (kvmesh and round robin in the row's send order, `simulate_in_send_order`), so the simulated
TTFT check with a shared tier covers every draw, not only those whose runs saved it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Sequence

from kvmesh.benchmarks.robust_live import (
    FAMILIES,
    live_checks,
    meets_no_tier_targets,
    simulate_in_send_order,
    within_tolerances,
)

ROW_FIELDS = ("seed", "replicas", "bounds", "kvmesh", "round_robin", "sim", "sim_vs_live")  # what every saved row has


def load_rows(paths: Iterable[str]) -> dict[int, dict]:
    """Seed -> saved row, over `paths` in order (a later file's row replaces an earlier one's). Raises
    ValueError naming the file when one is not a JSON list of rows."""
    rows: dict[int, dict] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
        if not isinstance(data, list) or not all(isinstance(r, dict) and all(k in r for k in ROW_FIELDS) for r in data):
            raise ValueError(f"{path}: not a list of live robustness rows (each with {', '.join(ROW_FIELDS)})")
        for r in data:
            rows[int(r["seed"])] = r
    return rows


def simulate_tier_arms(rows: dict[int, dict]) -> None:
    """Simulate every row's shared-tier arms again with the code now: kvmesh and round robin, in the send
    order of the row's draw (of its `family`, the first family when it names none) at its replica count
    (`sim_tier`, `sim_round_robin_tier`; about 1 s for 100 draws). Why: runs saved before those arms existed
    lack them, and saved ones came from the code then."""
    for seed, row in rows.items():
        d = FAMILIES[row.get("family", "family")].draw(seed)
        recs = d.records()
        row["sim_tier"] = simulate_in_send_order(recs, d, row["replicas"], "kvmesh", shared=True)
        row["sim_round_robin_tier"] = simulate_in_send_order(recs, d, row["replicas"], "round_robin", shared=True)


def _ratio(a: float | None, b: float | None) -> list[float]:
    """[a / b], or nothing when a run has no figure (every request failed) or b is 0."""
    return [a / b] if a is not None and b else []


def tally(rows: dict[int, dict]) -> dict:
    """Per check: the seeds it held on and missed; the seeds meeting every no-tier target; with LMCache,
    the seeds at the infinite-cache bound; and the median TTFT p50 ratio to round robin per arm."""
    per: dict[str, dict[str, list[int]]] = {}
    every, at_bound, tiered, sim_within = [], [], [], []
    ratios: dict[str, list[float]] = {"no tier": [], "with LMCache": []}
    for seed, row in sorted(rows.items()):
        checks = live_checks(row)
        for name, ok in checks.items():
            per.setdefault(name, {"held": [], "missed": []})["held" if ok else "missed"].append(seed)
        if meets_no_tier_targets(row, checks):
            every.append(seed)
        if within_tolerances(row["sim_vs_live"]):
            sim_within.append(seed)
        ratios["no tier"].extend(_ratio(row["kvmesh"]["ttft_p50_s"], row["round_robin"]["ttft_p50_s"]))
        if "kvmesh_tier" in row:
            tiered.append(seed)
            hit = row["kvmesh_tier"]["hit"]
            if hit is not None and hit >= row["bounds"]["infinite"] - 1e-9:
                at_bound.append(seed)
            if "round_robin_tier" in row:
                ratios["with LMCache"].extend(
                    _ratio(row["kvmesh_tier"]["ttft_p50_s"], row["round_robin_tier"]["ttft_p50_s"])
                )
    return {
        "draws": sorted(rows),
        "checks": per,
        "every_no_tier_target": every,
        "sim_within_every_tolerance": sim_within,
        "with_lmcache": tiered,
        "at_infinite_bound_with_lmcache": at_bound,
        "ttft_ratio_median": {k: statistics.median(v) for k, v in ratios.items() if v},
    }


def format_tally(t: dict) -> str:
    n = len(t["draws"])
    lines = [f"{n} draws ({t['draws'][0]}-{t['draws'][-1]})" if n else "no draws"]
    lines.append(f"  every live target without a tier: {len(t['every_no_tier_target'])}/{n}")
    lines.append(f"  the simulator within every sim-vs-live tolerance: {len(t['sim_within_every_tolerance'])}/{n}")
    if t["with_lmcache"]:
        missed = sorted(set(t["with_lmcache"]) - set(t["at_infinite_bound_with_lmcache"]))
        lines.append(
            f"  with LMCache at the infinite-cache bound: {len(t['at_infinite_bound_with_lmcache'])}/"
            f"{len(t['with_lmcache'])} (below: {missed})"
        )
    for arm, ratio in t["ttft_ratio_median"].items():
        lines.append(f"  TTFT p50 / round robin's, {arm}: median {ratio:.2f}")
    for name, seeds in t["checks"].items():
        held, missed = seeds["held"], seeds["missed"]
        lines.append(f"  {name}: {len(held)}/{len(held) + len(missed)}" + (f", missed {missed}" if missed else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="saved robust-live JSON files (BENCH_OUT/robust/robust-live.json)")
    parser.add_argument(
        "--simulate", action="store_true", help="simulate every row's shared-tier arms again with the code now"
    )
    args = parser.parse_args(argv)
    try:
        rows = load_rows(args.files)
    except ValueError as exc:
        parser.exit(2, f"live_tally: {exc}\n")
    if args.simulate:
        simulate_tier_arms(rows)
    print(format_tally(tally(rows)))
    return 0


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

"""Run placement policies over many workload-family draws in the simulator and summarise how close
each gets to the bounds on every draw.

Why: one trace can be tuned for; a distribution over shapes the policy was not tuned on says whether
it is robust. Per draw the report gives each policy's hit rate against the merged-LRU bound (with
room for every block, that is the infinite-cache bound) and against the balance-bounded bound (what
a placement keeping prefill max/mean <= 1.10 reaches), its margin over the best other policy, and its
per-replica prefill max/mean.

Arrivals. "poisson"/"bursts" draws use their timestamps, scaled to the draw's offered load, a user's next
turn no earlier than its previous reply's end (its prompt holds that reply). "all"
draws are sent by the simulator's closed-loop client (`kvmesh.cluster.simulator.ClosedLoop`): the draw's
concurrency in flight, a user's next turn after its previous reply, as the live replay client sends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.cluster.bounds import balance_bounded_bound, compute_bounds, online_bounded_greedy
from kvmesh.cluster.exact_placement import decide_target
from kvmesh.cluster.out_of_reach import target_out_of_reach
from kvmesh.cluster.simulator import ClosedLoop, SimConfig, simulate_policy
from kvmesh.cluster.stats import nearest_rank
from kvmesh.cluster.tier_reach import tier_target_out_of_reach
from kvmesh.cluster.trace import Trace, scale_to_load
from kvmesh.cluster.workload_family import draw
from kvmesh.cluster.workloads import engine_trace
from kvmesh.policies.cost_model import DEFAULT_COST_MODEL, CostModel
from kvmesh.policies.registry import PEERS, make_policy

DEFAULT_POLICIES: tuple[str, ...] = ("kvmesh", "round_robin", *PEERS)
METRICS = ("hit_over_merged", "hit_over_balance", "hit_minus_best_other", "prefill_max_over_mean")


class Draw(Protocol):
    """A workload shape drawn from a seed (`workload_family.FamilyDraw`, `workload_wide.WideDraw`)."""

    @property
    def seed(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def arrival(self) -> str: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def load(self) -> float: ...
    def records(self) -> list[dict]: ...
    def describe(self) -> str: ...
    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class SweepOptions:
    engine_block_size: int = 32  # the live engines' block size (a divisor of 32 and 64 tokens per block)
    capacity_blocks: int | None = None  # per replica; None = room for every block of the draw (no eviction)
    balance_limit: float = 1.10  # max/mean prefill the balance-bounded bound keeps to
    target_ratio: float = 0.97  # the target: hit >= target_ratio x merged-LRU bound ...
    target_imbalance: float = 1.25  # ... with prefill max/mean <= target_imbalance
    cost: CostModel = field(default_factory=lambda: DEFAULT_COST_MODEL)
    shared_tier: bool = True  # also run every policy with an unbounded shared tier (`evaluate_draw`)
    tier_chunk_blocks: int = 1  # that tier's LMCache chunk in engine blocks (the live sweep's: one block)


def draw_trace(d: Draw, opts: SweepOptions) -> tuple[Trace, dict]:
    """The draw as a simulator trace at the engine block size, and how it is sent (the simulator's
    `client`): for the timed patterns, at their timestamps scaled to the draw's load, a user's next turn
    no earlier than its previous reply's end (`ClosedLoop.timed`); for "all at once", the draw's
    concurrency in flight, a user's turns in order."""
    recs = d.records()
    users = [r.get("user") for r in recs]
    trace = engine_trace(recs, d.tokens_per_block, opts.engine_block_size, name=f"family-{d.seed}")
    if d.arrival != "all" and trace.requests[-1].timestamp_ms > trace.requests[0].timestamp_ms:
        c = opts.cost
        arrivals, _ = scale_to_load(
            trace, d.replicas, d.load, c.prefill_s_per_token, c.prefill_base_s, c.attention_s_per_token_pair
        )
        return trace, {"client": ClosedLoop.timed(arrivals, users)}
    return trace, {"client": ClosedLoop(d.concurrency, users)}


def prefill_max_over_mean(per_replica: dict) -> float:
    """max/mean over replicas of uncached prompt tokens computed (1.0 when nothing was computed)."""
    work = [v["prefill_tokens"] for v in per_replica.values()]
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def evaluate_draw(d: Draw, policies: Sequence[str] = DEFAULT_POLICIES, opts: SweepOptions = SweepOptions()) -> dict:
    """One row: the draw's shape, its bounds, and each policy's figures on it."""
    trace, sending = draw_trace(d, opts)
    bs = trace.block_size
    capacity = opts.capacity_blocks or 1 + len({h for r in trace.requests for h in r.hash_ids})
    bounds = compute_bounds(trace.requests, bs, d.replicas, capacity)
    balance = balance_bounded_bound(trace.requests, bs, d.replicas, opts.balance_limit)
    at_target = balance_bounded_bound(trace.requests, bs, d.replicas, opts.target_imbalance)
    online = online_bounded_greedy(trace.requests, bs, d.replicas)
    proof = target_out_of_reach(
        trace.requests, bs, d.replicas, opts.target_ratio * bounds["merged_lru"], opts.target_imbalance
    )

    def meets_target(placement: dict) -> bool:
        return placement["hit_rate"] >= opts.target_ratio * bounds["merged_lru"] and placement[
            "imbalance"
        ] <= opts.target_imbalance * (1 + 1e-9)

    cfg = SimConfig(d.replicas, capacity, cost=opts.cost, seed=d.seed)
    hits, work, ttft, tail = {}, {}, {}, {}
    for name in policies:
        m = _simulate(name, d, trace, cfg, sending, opts)
        hits[name] = m["hit_rate_tokens"]
        work[name] = prefill_max_over_mean(m["per_replica"])
        ttft[name] = m["ttft_p50_s"]
        tail[name] = m["ttft_p90_s"]
    with_tier = shared_tier_figures(d, trace, sending, capacity, bounds["merged_lru"], policies, opts)
    return {
        "seed": d.seed,
        "family": type(d).__module__.rsplit(".", 1)[-1],  # the module whose `draw(seed)` made it
        "shape": d.describe(),
        "draw": d.to_dict(),
        "requests": len(trace),
        "bounds": {
            "infinite": bounds["global_infinite"],
            "merged_lru": bounds["merged_lru"],
            "balance": balance["hit_rate"],
            "balance_imbalance": balance["imbalance"],
            "balance_fallbacks": balance["fallbacks"],
            # the same greedy at the target's imbalance: True when it found a placement meeting the target
            "balance_at_target": at_target["hit_rate"],
            "balance_at_target_imbalance": at_target["imbalance"],
            "target_reachable": meets_target(at_target),
            # the greedy without hindsight (cap x the running mean), at any of its caps
            "online_greedy_meets_target": any(meets_target(p) for p in online),
            # True: no placement meets the target (cluster/out_of_reach.py); False proves nothing
            "target_out_of_reach": proof["out_of_reach"],
            "computed_floor": proof["computed_floor"],
            "computed_allowed": proof["computed_allowed"],
        },
        "policies": policy_figures(hits, work, bounds["merged_lru"], balance["hit_rate"], ttft, tail),
        "shared_tier": with_tier,
    }


def _simulate(name: str, d: Draw, trace: Trace, cfg: SimConfig, sending: dict, opts: SweepOptions) -> dict:
    """Policy `name` (kvmesh with the sweep's cost model) over the draw's trace, sent as `draw_trace` says."""
    params = {"cost": opts.cost} if name == "kvmesh" else {}
    return simulate_policy(trace, cfg, make_policy(name, seed=d.seed, **params), **sending)


def shared_tier_figures(
    d: Draw,
    trace: Trace,
    sending: dict,
    capacity: int,
    merged: float,
    policies: Sequence[str],
    opts: SweepOptions,
) -> dict:
    """Per policy, the same draw with an unbounded shared tier behind every replica (LMCache's shared store:
    a block any replica computed loads on any other once its prefill has ended, and counts as cached, as
    vLLM reports it): hit / merged-LRU bound, prefill max/mean, p50 TTFT (s), and whether it meets the
    target. Empty when `opts.shared_tier` is off.

    Why: without a tier, hit rate and balance pull against each other (a conversation that leaves its
    history's replica recomputes it); with the tier a replica that lacks a prefix loads it instead, so
    placement is judged by balance and load time. The target is the placement target; this says what the
    tiered store adds to it."""
    if not opts.shared_tier:
        return {}
    cfg = SimConfig(
        d.replicas,
        capacity,
        shared=True,
        tier_store_at="computed",
        tier_chunk_blocks=opts.tier_chunk_blocks,
        cost=opts.cost,
        seed=d.seed,
    )
    out = {}
    for name in policies:
        m = _simulate(name, d, trace, cfg, sending, opts)
        ratio = m["hit_rate_tokens"] / merged if merged else 1.0
        imbalance = prefill_max_over_mean(m["per_replica"])
        out[name] = {
            "hit_over_merged": ratio,
            "prefill_max_over_mean": imbalance,
            "ttft_p50_s": m["ttft_p50_s"],
            "ttft_p90_s": m["ttft_p90_s"],
            "meets_target": ratio >= opts.target_ratio and imbalance <= opts.target_imbalance * (1 + 1e-9),
        }
    return out


def _redraw(row: dict) -> Draw:
    """The draw `row` was made from, by its workload family (rows saved without one: the first family)."""
    import importlib

    family = row.get("family", "workload_family")
    return importlib.import_module(f"kvmesh.cluster.{family}").draw(row["seed"])


def decide_exactly(row: dict, opts: SweepOptions = SweepOptions(), time_limit_s: float = 10.0) -> dict:
    """Settle whether any placement meets the target on `row`'s draw (`exact_placement.decide_target`), and
    record it in the row's bounds: `exact_verdict` ("reachable", "out of reach", "undecided") and, when
    reachable, the hit / merged-LRU bound and max/mean of the placement found. Why not in every row: it
    solves an integer program (up to twice `time_limit_s`), so the bench runs it where the floor left a
    miss undecided."""
    d = _redraw(row)
    trace, _ = draw_trace(d, opts)
    merged = row["bounds"]["merged_lru"]
    res = decide_target(
        trace.requests, trace.block_size, d.replicas, opts.target_ratio * merged, opts.target_imbalance, time_limit_s
    )
    b = row["bounds"]
    b["exact_verdict"] = res["verdict"]
    got = res["replayed"]
    b["exact_hit_over_merged"] = got["hit_rate"] / merged if got and merged else None
    b["exact_imbalance"] = got["imbalance"] if got else None
    return row


def decide_with_tier(
    row: dict, policy: str = "kvmesh", opts: SweepOptions = SweepOptions(), time_limit_s: float = 10.0
):
    """Settle whether any placement could meet the target on `row`'s draw with the shared tier
    (`tier_reach.tier_target_out_of_reach`) and record the verdict as `tier_verdict` in the row's
    `shared_tier` figures for `policy`. Run where the policy missed the target with the tier."""
    d = _redraw(row)
    trace, sending = draw_trace(d, opts)
    client = sending.get("client")
    res = tier_target_out_of_reach(
        trace.requests,
        trace.block_size,
        d.replicas,
        opts.target_ratio * row["bounds"]["merged_lru"],
        opts.target_imbalance,
        time_limit_s,
        client.users if client is not None else None,
        timed=client is not None and client.arrivals is not None,
    )
    row["shared_tier"][policy]["tier_verdict"] = res["verdict"]
    return row


def policy_figures(
    hits: dict[str, float],
    work: dict[str, float],
    merged: float,
    balance: float,
    ttft: dict[str, float] | None = None,
    tail: dict[str, float] | None = None,
) -> dict:
    """Per policy: hit, the ratios to both bounds, the margin over the best other policy, prefill max/mean,
    and p50 (`ttft`) and p90 (`tail`) TTFT in s where given."""
    out = {}
    for name, hit in hits.items():
        others = [h for n, h in hits.items() if n != name]
        out[name] = {
            "hit": hit,
            "hit_over_merged": hit / merged if merged else 1.0,
            "hit_over_balance": hit / balance if balance else 1.0,
            "hit_minus_best_other": hit - max(others) if others else 0.0,
            "prefill_max_over_mean": work[name],
        }
        if ttft is not None:
            out[name]["ttft_p50_s"] = ttft[name]
        if tail is not None:
            out[name]["ttft_p90_s"] = tail[name]
    return out


def sweep(
    seeds: Iterable[int],
    policies: Sequence[str] = DEFAULT_POLICIES,
    opts: SweepOptions = SweepOptions(),
    on_row=None,
    family: Callable[[int], Draw] = draw,
) -> list[dict]:
    """`evaluate_draw` for every seed of `family` (the first workload family by default), in order;
    `on_row(row)` after each (progress)."""
    rows = []
    for seed in seeds:
        rows.append(evaluate_draw(family(seed), policies, opts))
        if on_row is not None:
            on_row(rows[-1])
    return rows


# ------------------------------------------------------------------------------------- summary
def distribution(values: Iterable[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "min": v[0],
        "p10": nearest_rank(v, 0.10),
        "median": nearest_rank(v, 0.50),
        "p90": nearest_rank(v, 0.90),
        "max": v[-1],
    }


def summarize(rows: Sequence[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """policy -> metric -> {min, p10, median, p90, max} over the draws."""
    names = list(rows[0]["policies"])
    return {n: {m: distribution(r["policies"][n][m] for r in rows) for m in METRICS} for n in names}


def ttft_against(rows: Sequence[dict], base: str = "round_robin", arm: str = "policies") -> dict[str, dict]:
    """Per policy, the distribution over draws of its p50 and of its p90 TTFT divided by `base`'s on the same
    draw, in `arm` ("policies": one cache per replica; "shared_tier"), and on how many draws each is over 1.1.
    Why the p90 beside the p50: a rule that makes some requests wait (a hold, a queue behind a history's
    replica) shows there first."""
    out = {}
    for name in rows[0][arm]:
        got = {}
        for q in ("ttft_p50_s", "ttft_p90_s"):
            ratios = [r[arm][name][q] / r[arm][base][q] for r in rows if r[arm][base].get(q)]
            got[q] = {**distribution(ratios), "over_1.1": sum(1 for x in ratios if x > 1.1)} if ratios else {}
        out[name] = got
    return out


def target_misses(
    rows: Sequence[dict], policy: str = "kvmesh", min_ratio: float = 0.97, max_imbalance: float = 1.25
) -> list[dict]:
    """Draws where `policy` is below `min_ratio` x the merged-LRU bound or above `max_imbalance`."""
    return [
        r
        for r in rows
        if r["policies"][policy]["hit_over_merged"] < min_ratio
        or r["policies"][policy]["prefill_max_over_mean"] > max_imbalance
    ]


def shared_tier_summary(rows: Sequence[dict]) -> dict[str, dict]:
    """Per policy over the draws with the shared tier: how many meet the target, the distribution of
    hit / merged-LRU bound and of prefill max/mean, and the median ratio of p50 TTFT with the tier to
    p50 TTFT without it (below 1: loading beats recomputing)."""
    rows = [r for r in rows if r.get("shared_tier")]
    if not rows:
        return {}
    out = {}
    for name in rows[0]["shared_tier"]:
        ttft = [
            r["shared_tier"][name]["ttft_p50_s"] / r["policies"][name]["ttft_p50_s"]
            for r in rows
            if r["policies"][name].get("ttft_p50_s")
        ]
        out[name] = {
            "meets": sum(1 for r in rows if r["shared_tier"][name]["meets_target"]),
            "draws": len(rows),
            "hit_over_merged": distribution(r["shared_tier"][name]["hit_over_merged"] for r in rows),
            "prefill_max_over_mean": distribution(r["shared_tier"][name]["prefill_max_over_mean"] for r in rows),
            "ttft_with_over_without": nearest_rank(sorted(ttft), 0.50) if ttft else None,
        }
    return out


def format_shared_tier(summary: dict) -> str:
    lines = [
        f"{'policy':<20} {'meets':>7} {'hit/merged min':>15} {'median':>7} {'max/mean median':>16} {'p90':>6} "
        f"{'TTFT p50 with/without tier':>27}"
    ]
    for name, f in summary.items():
        ratio = f"{f['ttft_with_over_without']:.2f}" if f["ttft_with_over_without"] is not None else "-"
        lines.append(
            f"{name:<20} {f['meets']:>3}/{f['draws']:<3} {f['hit_over_merged']['min']:>15.3f} "
            f"{f['hit_over_merged']['median']:>7.3f} {f['prefill_max_over_mean']['median']:>16.2f} "
            f"{f['prefill_max_over_mean']['p90']:>6.2f} {ratio:>27}"
        )
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = [f"{'policy':<20} {'metric':<22} {'min':>7} {'p10':>7} {'median':>7} {'p90':>7} {'max':>7}"]
    for name, metrics in summary.items():
        for m, d in metrics.items():
            lines.append(
                f"{name:<20} {m:<22} " + " ".join(f"{d[k]:>7.3f}" for k in ("min", "p10", "median", "p90", "max"))
            )
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str, title: str | None = None) -> None:
    """Box plots over the draws, one box per policy, for each metric; and every draw's hit / merged-LRU
    bound against prefill max/mean per policy, with the target region marked. `title` names the set."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0]["policies"])
    titles = {
        "hit_over_merged": "hit / merged-LRU bound",
        "hit_over_balance": "hit / balance-bounded bound",
        "hit_minus_best_other": "hit - best other policy",
        "prefill_max_over_mean": "prefill max/mean",
    }
    refs = {"hit_over_merged": 0.97, "prefill_max_over_mean": 1.25, "hit_minus_best_other": 0.0}
    fig, axes = plt.subplots(2, 3, figsize=(18, 8))
    for ax, metric in zip(axes.flat, METRICS):
        ax.boxplot([[r["policies"][n][metric] for r in rows] for n in names], whis=(0, 100))
        ax.set_xticks(range(1, len(names) + 1), names, rotation=30, fontsize=8)
        ax.set_title(f"{titles[metric]} ({len(rows)} draws; whiskers min-max)", fontsize=10)
        if metric in refs:
            ax.axhline(refs[metric], color="tab:red", linestyle="--", linewidth=1)
    ax = axes.flat[4]
    for n in names:
        ax.scatter(
            [r["policies"][n]["prefill_max_over_mean"] for r in rows],
            [r["policies"][n]["hit_over_merged"] for r in rows],
            s=10,
            label=n,
            zorder=3 if n == "kvmesh" else 2,
            color="black" if n == "kvmesh" else None,
            alpha=1.0 if n == "kvmesh" else 0.35,
        )
    ax.axhline(0.97, color="tab:red", linestyle="--", linewidth=1)
    ax.axvline(1.25, color="tab:red", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("prefill max/mean")
    ax.set_ylabel("hit / merged-LRU bound")
    ax.set_title("per draw (target: above and left of the red lines)", fontsize=10)
    ax.legend(fontsize=7)
    ax = axes.flat[5]
    tiered = [r for r in rows if r.get("shared_tier")]
    if tiered:
        low = min(r["shared_tier"][n]["hit_over_merged"] for r in tiered for n in names)
        met = {n: sum(1 for r in tiered if r["shared_tier"][n]["meets_target"]) for n in names}
        ax.boxplot([[r["shared_tier"][n]["prefill_max_over_mean"] for r in tiered] for n in names], whis=(0, 100))
        ax.set_xticks(
            range(1, len(names) + 1), [f"{n}\n{met[n]}/{len(tiered)} meet" for n in names], rotation=30, fontsize=8
        )
        ax.axhline(1.25, color="tab:red", linestyle="--", linewidth=1)
        ax.set_title(
            "with an unbounded shared tier (LMCache): prefill max/mean\n"
            f"(hit / merged-LRU bound >= {low:.3f} on every draw)",
            fontsize=10,
        )
    else:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

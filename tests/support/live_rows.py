"""A saved live robustness row, built for the tests of what reads one (the bench's checks, its table, the
tally over saved slices)."""


def live_row(
    kvmesh_hit: float,
    peer_hit: float | None = None,
    seed: int = 2000,
    max_over_mean: float = 1.1,
    tier_hit: float | None = None,
) -> dict:
    """Two replicas, infinite-cache bound 0.8, balance-bounded 0.78; kvmesh at `kvmesh_hit` and TTFT p50
    100 ms, round robin at 0.5 and 200 ms; the simulator as live. With `peer_hit` a vllm-router leg; with
    `tier_hit` the LMCache legs (kvmesh at 300 ms, round robin at 0.7 and 200 ms)."""
    side = {
        "hit": kvmesh_hit,
        "prefill_max_over_mean": max_over_mean,
        "ttft_p50_s": 0.1,
        "errors": 0,
        "requests": [5, 5],
    }
    row = {
        "seed": seed,
        "replicas": 2,
        "requests": 10,
        "bounds": {"infinite": 0.8, "balance": 0.78},
        "kvmesh": side,
        "round_robin": dict(side, hit=0.5, ttft_p50_s=0.2),
        "sim": dict(side),
        "sim_vs_live": {"hit": 0.0, "prefill_max_over_mean": 0.0, "requests": 0.0},
    }
    if peer_hit is not None:
        row["peer"] = dict(side, hit=peer_hit, setup="vllm-router/cache_aware")
    if tier_hit is not None:
        row["kvmesh_tier"] = dict(side, hit=tier_hit, ttft_p50_s=0.3)
        row["round_robin_tier"] = dict(side, hit=0.7, ttft_p50_s=0.2)
        row["sim_tier"] = dict(side)
    return row

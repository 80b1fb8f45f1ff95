"""The simulation table's ratio column: a policy's hit rate over the merged-LRU bound of the same cache tiers."""

from __future__ import annotations

from kvmesh.cluster.sim_report import format_table, setup


def _doc(bounds: dict, host_blocks: int = 0) -> dict:
    policy = {
        "hit_rate_tokens": 0.185,
        "hit_rate_requests": 0.25,
        "imbalance": 1.0,
        "ttft_p50_s": 1.0,
        "ttft_p90_s": 2.0,
        "ttft_p99_s": 3.0,
        "utilization": 0.8,
        "throughput_tokens_s": 1000.0,
        "blended_cost": 1.0,
    }
    config = {"block_size": 512, "load": 0.5, "host_blocks": host_blocks, "max_tokens": None}
    return {
        "trace": "t",
        "requests": 10,
        "replicas": 4,
        "capacity_blocks": 100,
        "config": config,
        "bounds": bounds,
        "policies": {"kvmesh": policy},
    }


def _ratio_column(table: str) -> tuple[str, str]:
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("policy"))
    row = next(line for line in lines if line.startswith("kvmesh"))
    return head.split()[3], row.split()[3]


def test_with_host_tiers_the_ratio_is_to_the_bound_with_host_tiers():
    """A policy's hit rate counts its host-tier hits: divided by the HBM-only merged LRU it read 4.8 x "the
    bound" (kvmesh 0.1850 against 0.0383 on the conversation trace with --host-blocks 2000)."""
    bounds = {"global_infinite": 0.3, "merged_lru": 0.0383, "merged_lru_with_host": 0.1911}
    assert _ratio_column(format_table(_doc(bounds, host_blocks=2000))) == ("/merged+host", "0.968")


def test_without_host_tiers_the_ratio_is_to_the_merged_lru():
    bounds = {"global_infinite": 0.3, "merged_lru": 0.2}
    assert _ratio_column(format_table(_doc(bounds))) == ("/merged", "0.925")


def test_the_setup_line_says_a_replays_output_cap():
    doc = _doc({"merged_lru": 0.2})
    assert "max_tokens" not in setup(doc)
    doc["config"]["max_tokens"] = 16
    assert "max_tokens=16" in setup(doc).split()

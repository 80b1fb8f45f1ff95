"""The simulation table's ratio column: a policy's hit rate over the merged-LRU bound of the same cache tiers."""

from __future__ import annotations

import pytest

from kvmesh.cluster.sim_report import format_table, setup
from kvmesh.cluster.simulator import SimConfig, simulate
from kvmesh.cluster.trace import Trace, TraceRequest
from kvmesh.policies.registry import make_policy


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


def _shared_doc(shared_blocks: int | None, host_blocks: int = 0) -> dict:
    """Two replicas of 1 block each behind a shared tier; request i + 2 repeats request i's 3-block prompt, so
    the fleet's HBM (2 blocks) keeps none of it and only the shared tier (or host tiers) can serve the repeats."""
    prompts = [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]]
    reqs = [TraceRequest(float(k), 13, 1, ids) for k, ids in enumerate(prompts)]
    cfg = SimConfig(2, 1, host_blocks=host_blocks, shared=True, shared_blocks=shared_blocks)
    return simulate(Trace("t", reqs, 4), cfg, {"kvmesh": make_policy("round_robin")})


@pytest.mark.parametrize(
    ("shared_blocks", "host_blocks", "bound"),
    [(None, 0, 24 / 52), (2, 0, 8 / 52), (3, 0, 16 / 52), (1, 1, 16 / 52), (None, 1, 24 / 52)],
    ids=["unbounded", "4 blocks in all", "5 blocks in all", "hbm 2 + host 2 + shared 1", "unbounded with host"],
)
def test_with_a_shared_tier_the_ratio_is_to_the_merged_lru_of_hbm_host_and_shared_tiers(
    shared_blocks, host_blocks, bound
):
    """A policy's hit rate counts its shared-tier hits: divided by the HBM-only merged LRU it read 8.3 x "the
    bound" (round_robin 0.3196 against 0.0387 on 3000 conversation requests, 8 replicas x 50 blocks, --shared).
    The bound of the same tiers is one LRU of HBM + host + shared blocks (one LRU over these 6 blocks hits
    nothing in 3 blocks, 8 of 52 tokens in 4, 16 in 5, 24 in 6); an unbounded shared tier holds every block,
    so it is the infinite bound."""
    doc = _shared_doc(shared_blocks, host_blocks)
    b = doc["bounds"]
    assert b["merged_lru"] == 0.0 and b["global_infinite"] == pytest.approx(24 / 52)
    assert b["merged_lru_with_shared"] == pytest.approx(bound)
    head, ratio = _ratio_column(format_table(doc))
    assert head == "/merged+shared"
    hit = doc["policies"]["kvmesh"]["hit_rate_tokens"]
    assert ratio == (f"{hit / bound:.3f}" if bound else "n/a")


def test_without_a_shared_tier_there_is_no_shared_bound():
    doc = simulate(
        Trace("t", [TraceRequest(0.0, 13, 1, [1, 2, 3])], 4), SimConfig(2, 1), {"r": make_policy("round_robin")}
    )
    assert set(doc["bounds"]) == {"global_infinite", "merged_lru"}


def test_the_plot_names_the_bound_the_ratio_column_divides_by():
    from kvmesh.cluster.sim_report import bound_lines

    doc = _shared_doc(None)
    texts = [text for text, *_ in bound_lines(doc["bounds"])]
    assert [t for t in texts if "reference" in t] == [
        f"merged_lru_with_shared {doc['bounds']['merged_lru_with_shared']:.3f} (/merged+shared reference)"
    ]
    assert bound_lines({"merged_lru": 0.2})[0][0] == "merged_lru 0.200 (/merged reference)"

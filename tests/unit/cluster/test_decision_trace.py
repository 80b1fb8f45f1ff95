"""Decision traces: two traces that place alike up to replica names agree; the first request they place
differently is found and shown with both sides' views, renamed alike."""

from __future__ import annotations

from kvmesh.cluster.decision_trace import CELLS, decision, first_divergence, format_divergence, replica_cells


def _trace(chosen: list[str], replicas: list[str], work=None) -> list[dict]:
    out = []
    for k, rid in enumerate(chosen):
        views = {
            r: [
                k,
                k,
                k,
                0,
                0,
                10 * k,
            ]
            for r in replicas
        }
        out.append(decision(k, rid, replica_cells(views, work)))
    return out


def test_traces_that_place_alike_up_to_replica_names_agree():
    a = _trace(["x", "y", "x", "z"], ["x", "y", "z"])
    b = _trace(["q", "p", "q", "s"], ["p", "q", "s"])
    assert first_divergence(a, b, [0, 1, 2, 3]) is None


def test_the_first_request_placed_differently_is_found_with_both_views_renamed():
    a = _trace(["x", "y", "y"], ["x", "y", "z"], work={"x": 1.0, "y": 2.04})
    b = _trace(["q", "p", "s"], ["p", "q", "s"], work={"p": 3.0})
    div = first_divergence(a, b, [0, 1, 2])
    assert div is not None and (div["request"], div["position"]) == (2, 2)
    # live reused its second replica, the simulator took a third, unused one
    assert div["a"]["chosen"] == "r1" and div["b"]["chosen"] == "u0"
    assert list(div["a"]["replicas"]) == ["r0", "r1", "u0"]
    assert div["a"]["replicas"]["r1"][CELLS.index("work")] == 2.0
    assert div["b"]["replicas"]["r0"][CELLS.index("work")] == 0.0  # a replica the guard had no work for
    text = "\n".join(format_divergence(div, head="  2064: "))
    assert text.startswith("  2064: first placement that differs: request 2")
    assert "r1: hbm 2 host 2 shared 2 queued 0 running 0 pending 20 work 2.0" in text


def test_requests_one_side_did_not_record_are_skipped_and_order_decides():
    a = _trace(["x", "y", "x"], ["x", "y"])
    b = _trace(["p", "q", "q"], ["p", "q"])
    assert first_divergence(a, b, [0, 1, 2])["request"] == 2
    assert first_divergence(a, b[:2], [0, 1, 2]) is None  # the simulator's side lacks request 2
    assert first_divergence(a, b, [1, 0, 2])["position"] == 2  # renamed in this order: the same placements
    assert first_divergence(a, b, [0, 1, 2])["sent_apart"] is None  # both routed 0, 1, 2
    div = first_divergence([a[1], a[0], a[2]], b, [0, 1, 2])
    assert div["sent_apart"] == [0, 1, 0]  # live routed request 1 first
    assert "routed in another order from #0: live 1, sim 0" in "\n".join(format_divergence(div))


def test_a_policy_without_guard_work_leaves_the_cell_empty():
    cells = replica_cells({"x": [1, 1, 2, 0, 3, 5]}, None)
    assert cells == {"x": [1, 1, 2, 0, 3, 5, None, None]}
    div = first_divergence(
        [decision(0, "x", cells), decision(1, "x", cells)], [decision(0, "p", {}), decision(1, "q", {})], [0, 1]
    )
    assert "work" not in "\n".join(format_divergence(div))
    scored = replica_cells({"x": [0] * 6, "y": [0] * 6}, {"x": 1.0}, {"x": 0.123456789, "y": float("nan")})
    assert scored["x"][-1] == 0.12346 and scored["y"][-1] is None  # a replica the policy scored NaN


def test_a_large_fleet_keeps_the_chosen_and_the_best_scored_replicas():
    from types import SimpleNamespace

    import numpy as np

    from kvmesh.cluster.decision_trace import TRACED_REPLICAS, ranking_cells
    from kvmesh.policies.base import FleetView, ReplicaView

    views = [
        ReplicaView(f"x{k:02d}", hbm_blocks=k % 3, host_blocks=k % 3, shared_blocks=k, queued=1) for k in range(20)
    ]
    fleet = FleetView.from_views(views)
    scores = np.array([float(20 - k) for k in range(20)])
    scores[19] = np.nan
    policy = SimpleNamespace(last_scores=scores, recent_work=lambda ids: {r: 2.0 for r in ids})
    cells = ranking_cells(policy, fleet, top=0)
    assert sorted(cells) == ["x00"] + [f"x{k}" for k in range(11, 19)]  # NaN scored last
    assert len(cells) == TRACED_REPLICAS + 1
    assert cells["x12"] == [0, 0, 12, 1, 0, 0, 2.0, 8.0]
    # no scores kept: the longest prefixes, and no work either
    cells = ranking_cells(SimpleNamespace(), fleet, top=3)
    assert sorted(cells) == ["x03"] + [f"x{k}" for k in range(12, 20)]
    assert cells["x03"][-2:] == [None, None]
    # a small fleet keeps every replica
    small = FleetView.from_views(views[:4])
    assert len(ranking_cells(SimpleNamespace(last_scores=np.zeros(4)), small, top=1)) == 4

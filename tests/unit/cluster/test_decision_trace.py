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


def test_a_policy_without_guard_work_leaves_the_cell_empty():
    cells = replica_cells({"x": [1, 1, 2, 0, 3, 5]}, None)
    assert cells == {"x": [1, 1, 2, 0, 3, 5, None, None]}
    div = first_divergence(
        [decision(0, "x", cells), decision(1, "x", cells)], [decision(0, "p", {}), decision(1, "q", {})], [0, 1]
    )
    assert "work" not in "\n".join(format_divergence(div))
    scored = replica_cells({"x": [0] * 6, "y": [0] * 6}, {"x": 1.0}, {"x": 0.123456789, "y": float("nan")})
    assert scored["x"][-1] == 0.12346 and scored["y"][-1] is None  # a replica the policy scored NaN

"""`kvmesh simulate` keeps tenants apart as `kvmesh trace bounds` does, with or without `--tokens-per-block`: on a
trace whose two tenants use the same ids, the default read let them share blocks (a bound of 0.9454 where
trace bounds gave 0.896 for the same trace and block size)."""

from __future__ import annotations

import json

import pytest

from kvmesh.deployments.cli import main


def _trace(tmp_path):
    rows = [
        {"timestamp": 100 * i, "input_length": 2058, "output_length": 8, "hash_ids": [1, 2, 3, 4, 100 + i]}
        | {"tenant": f"t{i % 2}"}
        for i in range(20)
    ]
    path = tmp_path / "tenants.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_simulate_and_trace_bounds_give_one_bound_for_a_trace_whose_tenants_share_ids(tmp_path, capsys):
    trace, out = _trace(tmp_path), tmp_path / "o.json"
    sim = ["simulate", "--trace", trace, "--replicas", "2", "--capacity-blocks", "100", "--policies", "round_robin"]
    bounds = []
    for extra in ([], ["--tokens-per-block", "512"]):
        assert main([*sim, *extra, "--no-progress", "--json", str(out)]) == 0
        bounds.append(json.loads(out.read_text())["bounds"]["global_infinite"])
    assert main(["trace", "bounds", "--trace", trace, "--json", str(out)]) == 0
    bounds.append(json.loads(out.read_text())["infinite"]["hit_rate"])
    capsys.readouterr()
    assert bounds == pytest.approx([bounds[2]] * 3)
    assert bounds[0] == pytest.approx(18 * 4 * 512 / (20 * 2058))  # all but each tenant's first hit its 4 blocks

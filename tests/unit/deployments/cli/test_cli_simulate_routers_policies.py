"""`kvmesh simulate` with the multi-router model and its policies: every named policy is checked before any is
run. With the default `--policies all`, --routers, --event-delay-ms or --churn-every-s ran several policies and
then exited 2 on llmd_precise (it reads engine signals that model does not keep), so docs/scale.md's
`kvmesh simulate ... --routers R --event-delay-ms D` failed; `--router-sync off` with one router did the same,
switching to the multi-router model for nothing."""

from __future__ import annotations

import json

import pytest

from kvmesh.cluster import multi_router
from kvmesh.deployments.cli import main
from kvmesh.policies.registry import POLICY_NAMES

UNMODELLED = ["llmd_precise", "dynamo_cost"]  # engine waiting queue / KV usage, Dynamo's booked blocks


def _trace(tmp_path):
    rows = [
        {"timestamp": 100 * i, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 10 + i % 3]}
        for i in range(12)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sim(tmp_path, *extra):
    out = tmp_path / "s.json"
    argv = ["simulate", "--trace", _trace(tmp_path), "--replicas", "3", "--capacity-blocks", "50", "--no-progress"]
    rc = main([*argv, "--json", str(out), *extra])
    return rc, (json.loads(out.read_text()) if rc == 0 else None)


@pytest.mark.parametrize(
    "flags",
    [
        ["--routers", "2"],
        ["--event-delay-ms", "100"],
        ["--churn-every-s", "5"],
        ["--routers", "2", "--router-sync", "off"],
    ],
)
def test_all_policies_leave_out_the_unmodelled_ones_and_say_so(tmp_path, capsys, flags):
    rc, doc = _sim(tmp_path, *flags)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert list(doc["policies"]) == [n for n in POLICY_NAMES if n not in UNMODELLED]
    notes = [line for line in err.splitlines() if "leaves out" in line]
    assert len(notes) == 1 and all(n in notes[0] for n in UNMODELLED), err


def test_an_unmodelled_policy_named_is_refused_before_any_policy_runs(tmp_path, capsys, monkeypatch):
    ran = []
    real = multi_router.simulate_routers
    monkeypatch.setattr(multi_router, "simulate_routers", lambda *a, **k: ran.append(1) or real(*a, **k))
    rc, _ = _sim(tmp_path, "--routers", "2", "--policies", "kvmesh,llmd_precise")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "llmd_precise" in err and "--router-sync" in err and "--routers" in err, err
    assert ran == []  # kvmesh, named first, was not simulated only to be thrown away


def test_router_sync_off_with_one_router_is_the_one_router_model(tmp_path, capsys):
    """One router has no peer to sync with: the run is the one without the flag, every policy included."""
    rc, off = _sim(tmp_path, "--router-sync", "off")
    assert rc == 0, capsys.readouterr().err
    rc, plain = _sim(tmp_path)
    assert rc == 0
    assert list(off["policies"]) == list(POLICY_NAMES)
    assert all("routers" not in m for m in off["policies"].values())  # the multi-router model reports its setup
    for name in POLICY_NAMES:
        assert off["policies"][name]["hit_rate_tokens"] == plain["policies"][name]["hit_rate_tokens"]

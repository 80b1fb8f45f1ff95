"""`kvmesh demo --simulate --tiers`: every run has tiers, so every column is headed NAME+tiers; the columns
kept the plain names `kvmesh` and `round_robin` while they ran tiered."""

from __future__ import annotations

import json

from kvmesh.deployments.cli import build_parser, main


def test_tiers_heads_every_run_as_tiered(tmp_path, capsys):
    out = tmp_path / "demo.json"
    argv = ["demo", "--simulate", "--tiers", "--conversations", "4", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    # the default kvmesh,round_robin,kvmesh+tiers: kvmesh+tiers once, not twice
    assert list(results) == ["kvmesh+tiers", "round_robin+tiers"]
    assert all(r["hit_tokens_by_tier"] for r in results.values())
    header = next(line for line in text.splitlines() if "kvmesh+tiers" in line)
    assert header.split() == ["kvmesh+tiers", "round_robin+tiers"]
    assert "kvmesh+tiers computes" in text and "round robin+tiers computes" in text


def test_without_tiers_the_plain_runs_keep_their_names(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "--simulate", "--conversations", "4", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["results"]) == ["kvmesh", "round_robin", "kvmesh+tiers"]
    assert "kvmesh computes" in capsys.readouterr().out


def test_the_tiers_help_does_not_say_live_only():
    """--tiers changes simulated runs too."""
    demo = build_parser("demo")._subparsers._group_actions[0].choices["demo"]
    tiers = next(a for a in demo._actions if "--tiers" in a.option_strings)
    assert not tiers.help.startswith("live:") and "simulated" in tiers.help

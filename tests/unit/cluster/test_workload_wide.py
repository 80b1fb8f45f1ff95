"""The second workload family: one seed, one shape, the same records every time; its shapes are the ones the
first family never draws (conversations of different lengths in one draw, unequal popularity of system
prompts, one-shot traffic, fleets up to 16 replicas), and its records keep the Mooncake rules and fit the live
context. The sweep runs it like the first family."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from family_checks import check_family_records
from paths import REPO_ROOT

from kvmesh.cluster import workload_family
from kvmesh.cluster.sweep import SweepOptions, sweep, ttft_against
from kvmesh.cluster.workload_family import ARRIVALS
from kvmesh.cluster.workload_wide import MAX_REQUESTS, MAX_TURNS, MIN_REQUESTS_PER_REPLICA, draw, records

with open(REPO_ROOT / "benchmarks" / "robust_seeds.json", encoding="utf-8") as fh:
    SETS = json.load(fh)
WIDE = SETS["wide_eval"]


def test_the_wide_seeds_meet_no_other_set_and_say_what_they_are_for():
    assert len(set(WIDE)) == len(WIDE) >= 100
    assert not set(WIDE) & (set(SETS["tune"]) | set(SETS["eval"]))
    assert "wide_eval" in SETS["_doc"] and "workload_wide" in SETS["_doc"]


def test_same_seed_same_shape_and_records_other_seed_other_shape():
    assert draw(11000) == draw(11000) and records(draw(11000)) == records(draw(11000))
    assert draw(11000) != draw(11001) and records(draw(11000)) != records(draw(11001))


@pytest.mark.parametrize("seed", WIDE[:60])
def test_records_keep_the_mooncake_rules_the_limits_and_the_context(seed):
    d = draw(seed)
    recs = records(d)
    assert MIN_REQUESTS_PER_REPLICA * d.replicas <= d.requests <= MAX_REQUESTS
    check_family_records(d, recs)
    last: dict[str, dict] = {}
    for r in recs:  # a conversation's turn carries every turn before it
        prev = last.get(r["user"])
        if prev is not None:
            assert r["hash_ids"][: len(prev["hash_ids"])] == prev["hash_ids"]
        last[r["user"]] = r


def test_the_wide_family_draws_what_the_first_one_never_does():
    shapes = [draw(s) for s in WIDE]
    first = [workload_family.draw(s) for s in SETS["eval"]]
    assert max(d.replicas for d in shapes) > max(d.replicas for d in first) == 8
    assert {d.arrival for d in shapes} == set(ARRIVALS)
    uneven = oneshot = 0
    for d in shapes:
        recs = records(d)
        turns = Counter(r["user"] for r in recs if not r["user"].startswith("one-"))
        assert max(turns.values()) <= MAX_TURNS
        uneven += len(set(turns.values())) > 1  # conversations of different lengths in one draw
        oneshot += any(r["user"].startswith("one-") for r in recs)
    assert uneven > 0.8 * len(shapes) and 0.2 * len(shapes) < oneshot < 0.8 * len(shapes)
    # the first family: every conversation of a draw has the same number of turns
    for d in first[:30]:
        recs = workload_family.records(d)
        chat = Counter(r["user"] for r in recs if "-flood-" not in r["user"])
        assert len(set(chat.values())) == 1


def test_a_popular_system_prompt_carries_more_conversations():
    shapes = [draw(s) for s in WIDE]
    d = next(d for d in shapes if d.popularity > 1.2 and d.groups >= 4 and d.conversations >= 30)
    users = Counter(u.split("-")[1] for u in {r["user"] for r in records(d) if not r["user"].startswith("one-")})
    assert users["g0"] == max(users.values()) and users["g0"] >= 3 * min(users.values())


def test_the_sweep_runs_the_wide_family_and_compares_ttft_with_round_robin():
    rows = sweep(WIDE[:3], ("kvmesh", "round_robin"), SweepOptions(), family=draw)
    assert [r["seed"] for r in rows] == WIDE[:3] and all("oneshot" in r["shape"] for r in rows)
    for r in rows:
        for arm in ("policies", "shared_tier"):
            assert r[arm]["kvmesh"]["ttft_p90_s"] >= r[arm]["kvmesh"]["ttft_p50_s"] > 0
    tails = ttft_against(rows, "round_robin", "shared_tier")
    assert tails["round_robin"]["ttft_p90_s"]["median"] == 1.0 and tails["round_robin"]["ttft_p90_s"]["over_1.1"] == 0
    k = tails["kvmesh"]["ttft_p50_s"]
    tier = [r["shared_tier"] for r in rows]
    ratios = sorted(t["kvmesh"]["ttft_p50_s"] / t["round_robin"]["ttft_p50_s"] for t in tier)
    assert k["min"] == ratios[0] and k["max"] == ratios[-1]


@pytest.mark.parametrize("mean_turns", [2.0, 4.0, 6.0])
def test_the_turns_a_draw_describes_are_the_mean_of_the_turns_its_conversations_have(mean_turns):
    """`mean_turns` sets 1 + floor(X), X exponential with mean `mean_turns` - 1: about `mean_turns` - 0.5 turns
    a conversation. The description prints that mean (`expected_turns`), not `mean_turns`. Many conversations,
    system prompts of one block and 32 tokens per block, so that the context cuts (almost) none short."""
    from dataclasses import replace

    d = replace(
        draw(11000),
        mean_turns=mean_turns,
        conversations=3000,
        system_blocks=(1, 1),
        tokens_per_block=32,
        oneshot_share=0.0,
        arrival="all",
    )
    turns = Counter(r["user"] for r in records(d))
    seen = sum(turns.values()) / len(turns)
    assert len(turns) == 3000 and abs(seen - d.expected_turns) < 0.15
    assert abs(seen - mean_turns) > 0.3  # the old description, `mean_turns` itself, was this far off
    assert f" ~{d.expected_turns:.1f}turns " in d.describe() and f" ~{mean_turns:.1f}turns " not in d.describe()

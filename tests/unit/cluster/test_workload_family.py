"""Workload families: one seed, one shape, the same records every time; shapes stay inside their
ranges, records keep the Mooncake rules and fit the live context; the tune and eval seed sets never meet."""

from __future__ import annotations

import json

import pytest
from family_checks import check_family_records
from paths import REPO_ROOT

from kvmesh.cluster.workload_family import (
    ARRIVALS,
    MAX_REQUESTS,
    MIN_REQUESTS,
    draw,
    records,
)

SEEDS_FILE = str(REPO_ROOT / "benchmarks" / "robust_seeds.json")


def _seed_sets() -> dict:
    with open(SEEDS_FILE, encoding="utf-8") as fh:
        return json.load(fh)


ALL_SEEDS = [s for key in ("tune", "eval") for s in _seed_sets()[key]]


def test_seed_sets_are_disjoint_large_enough_and_say_what_they_are_for():
    sets = _seed_sets()
    assert not set(sets["tune"]) & set(sets["eval"])
    assert len(set(sets["eval"])) == len(sets["eval"]) >= 60
    assert len(set(sets["tune"])) == len(sets["tune"]) >= 20
    assert "tun" in sets["_doc"] and "reporting only" in sets["_doc"]


def test_same_seed_same_shape_and_records_other_seed_other_shape():
    assert draw(2000) == draw(2000)
    assert records(draw(2000)) == records(draw(2000))
    assert draw(2000) != draw(2001)
    assert records(draw(2000)) != records(draw(2001))


def test_shapes_stay_inside_their_ranges():
    for seed in ALL_SEEDS:
        d = draw(seed)
        assert d.seed == seed
        assert 1 <= d.groups <= 6 and 1 <= d.tenants <= d.groups
        assert 1 <= d.users_per_group <= 8 and 1 <= d.turns <= 8 and 0 <= d.system_blocks <= 10
        assert 1 <= d.question_blocks[0] <= d.question_blocks[1]
        assert 0 < d.answer_blocks[0] <= d.answer_blocks[1]
        assert d.rag_docs == 0 or (2 <= d.rag_docs <= 6 and d.rag_doc_blocks >= 2 and 0 < d.rag_share <= 1)
        assert d.flood_requests == 0 or d.flood_requests >= 8
        assert d.arrival in ARRIVALS and (d.bursts >= 2) == (d.arrival == "bursts")
        assert 1 <= d.concurrency <= 16 and d.tokens_per_block in (32, 64)
        assert 2 <= d.replicas <= 8 and 3 <= d.live_replicas <= 4
        assert MIN_REQUESTS <= d.requests <= MAX_REQUESTS


def test_the_eval_family_covers_every_kind_of_shape():
    shapes = [draw(s) for s in _seed_sets()["eval"]]
    assert {d.arrival for d in shapes} == set(ARRIVALS)
    assert {d.tokens_per_block for d in shapes} == {32, 64}
    assert any(d.rag_docs for d in shapes) and any(d.flood_requests for d in shapes)
    assert any(d.system_blocks == 0 for d in shapes) and any(d.groups == 1 for d in shapes)
    assert len({d.replicas for d in shapes}) == 7


@pytest.mark.parametrize("seed", ALL_SEEDS)
def test_records_keep_the_mooncake_rules_and_fit_the_context(seed):
    d = draw(seed)
    check_family_records(d, records(d))


@pytest.mark.parametrize("seed", _seed_sets()["eval"][:20])
def test_each_turn_carries_the_whole_conversation_before_it(seed):
    last: dict[str, dict] = {}
    for r in records(draw(seed)):
        prev = last.get(r["user"])
        if prev is not None:
            assert r["hash_ids"][: len(prev["hash_ids"])] == prev["hash_ids"]
            assert len(r["hash_ids"]) > len(prev["hash_ids"])
        last[r["user"]] = r


def test_a_flood_shares_one_hot_prompt_and_a_rag_document_is_shared():
    flood = next(d for d in map(draw, ALL_SEEDS) if d.flood_requests)
    hot = [r["hash_ids"][: flood.flood_prompt_blocks] for r in records(flood) if "-flood-" in r["user"]]
    assert len(hot) == flood.flood_requests and all(h == hot[0] for h in hot)
    rag = next(d for d in map(draw, ALL_SEEDS) if d.rag_docs and d.users_per_group >= 4 and d.rag_share > 0.6)
    firsts = {}
    for r in records(rag):
        firsts.setdefault(r["user"], r["hash_ids"][rag.system_blocks : rag.system_blocks + rag.rag_doc_blocks])
    assert len({tuple(v) for v in firsts.values()}) < len(firsts)  # some users pulled the same document

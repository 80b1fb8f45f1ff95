"""The balance-bounded bound: between round robin over unbounded caches and the infinite cache, within
its imbalance where that is feasible, trading hit rate for balance where affinity piles work up, and
reported by `kvmesh simulate`."""

from __future__ import annotations

import json

import pytest

from kvmesh.cluster.block_cache import leading_held
from kvmesh.cluster.bounds import balance_bounded_bound, infinite_hit_rate
from kvmesh.cluster.trace import TraceRequest
from kvmesh.cluster.workloads import ChatSpec, engine_trace, synth_chat
from kvmesh.policies.cost_model import cacheable_blocks, cached_tokens


def _round_robin_infinite(requests, block_size, replicas) -> float:
    held = [set() for _ in range(replicas)]
    hit = total = 0
    for i, r in enumerate(requests):
        h = held[i % replicas]
        hit += cached_tokens(leading_held(r.hash_ids, h), r.input_length, block_size)
        total += r.input_length
        h.update(r.hash_ids[: cacheable_blocks(r.input_length, len(r.hash_ids), block_size)])
    return hit / total


@pytest.mark.parametrize("replicas", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_between_round_robin_and_infinite_and_within_its_imbalance_on_chat(replicas, seed):
    trace = engine_trace(synth_chat(ChatSpec(tenants=2, groups=2, users=6, turns=4, seed=seed)), 32)
    reqs, bs = trace.requests, trace.block_size
    b = balance_bounded_bound(reqs, bs, replicas)
    assert _round_robin_infinite(reqs, bs, replicas) <= b["hit_rate"] <= infinite_hit_rate(reqs, bs) + 1e-12
    assert b["imbalance"] <= 1.10 + 1e-9
    prefill = b["per_replica_prefill"]
    assert len(prefill) == replicas and b["imbalance"] == pytest.approx(max(prefill) / (sum(prefill) / replicas))
    assert sum(prefill) == pytest.approx(sum(r.input_length for r in reqs) * (1 - b["hit_rate"]))


def test_without_a_limit_it_is_pure_affinity_and_reaches_the_infinite_cache_bound():
    trace = engine_trace(synth_chat(ChatSpec(seed=3)), 32)
    b = balance_bounded_bound(trace.requests, 32, 4, max_imbalance=float("inf"))
    assert b["hit_rate"] == pytest.approx(infinite_hit_rate(trace.requests, 32))


def test_where_affinity_piles_up_the_bound_trades_hit_rate_for_balance():
    # 40 requests sharing a 16-block prompt, each with 1 block of its own (block size 4): affinity puts
    # them all on one replica; within 1.10 the second replica must compute the prompt once more.
    reqs = [TraceRequest(i, 17 * 4 + 1, 4, list(range(16)) + [100 + i, 1000 + i]) for i in range(40)]
    pure = balance_bounded_bound(reqs, 4, 2, max_imbalance=float("inf"))
    assert pure["imbalance"] == pytest.approx(2.0) and pure["per_replica_prefill"][1] == 0
    bounded = balance_bounded_bound(reqs, 4, 2)
    assert bounded["imbalance"] <= 1.10
    assert bounded["hit_rate"] < pure["hit_rate"] == pytest.approx(infinite_hit_rate(reqs, 4))
    # what it gave up is about one more copy of the prompt (64 tokens), not per-request recompute
    total = sum(r.input_length for r in reqs)
    assert (pure["hit_rate"] - bounded["hit_rate"]) * total <= 2 * 64


def test_bad_replica_count_is_refused():
    with pytest.raises(ValueError):
        balance_bounded_bound([], 4, 0)


def test_simulate_reports_it_beside_the_other_bounds(tmp_path, capsys):
    from kvmesh.cluster.workloads import write_jsonl
    from kvmesh.deployments.cli import main

    trace, out = tmp_path / "chat.jsonl", tmp_path / "sim.json"
    write_jsonl(synth_chat(ChatSpec(users=3, turns=3)), trace)
    rc = main(
        [
            "simulate",
            "--trace",
            str(trace),
            "--replicas",
            "2",
            "--capacity-blocks",
            "1000",
            "--policies",
            "round_robin",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    bal = doc["balance_bounded"]
    assert bal["max_imbalance"] == 1.10 and len(bal["per_replica_prefill"]) == 2
    assert doc["policies"]["round_robin"]["hit_rate_tokens"] <= bal["hit_rate"] <= doc["bounds"]["global_infinite"]
    assert f"balance_bounded={bal['hit_rate']:.4f}" in capsys.readouterr().out


def test_online_greedy_needs_no_hindsight_and_loses_what_only_hindsight_keeps():
    """One long conversation first, then short ones: capped at the running mean, the conversation's
    later turns no longer fit on its replica while it is most of the work so far, so the online greedy
    recomputes history the hindsight passes (capped at the final mean) keep."""
    from kvmesh.cluster.bounds import online_bounded_greedy

    bs = 4
    history: list[int] = []
    reqs = []
    for turn in range(8):  # one conversation: each turn's prompt holds the whole history
        history += [1000 + 10 * turn + k for k in range(4)]
        reqs.append(TraceRequest(turn, len(history) * bs + 1, 4, list(history)))
    reqs += [TraceRequest(100 + i, 4 * bs + 1, 4, [5000 + 10 * i + k for k in range(4)]) for i in range(40)]
    online = online_bounded_greedy(reqs, bs, 2)
    hindsight = balance_bounded_bound(reqs, bs, 2, 1.25)
    assert [p["max_imbalance"] for p in online] == [1.10, 1.15, 1.20, 1.25]
    assert max(p["hit_rate"] for p in online) < hindsight["hit_rate"]
    assert hindsight["imbalance"] <= 1.25


def test_the_infinite_cache_bound_holds_in_every_order_of_arrival():
    """A prompt ending on a block boundary computes its last block but stores it: a longer prompt through that
    block hits it only if it comes after. The bound holds whatever order a simulator sends requests in."""
    import itertools
    import random

    rng = random.Random(5)
    bs = 4
    for _ in range(200):
        reqs = []
        for _ in range(rng.randint(2, 5)):
            n_blocks = rng.randint(1, 3)
            ids = [rng.randint(1, 2) * 10 + k for k in range(n_blocks)]  # two shared chains: 10,11,12 / 20,21,22
            tokens = n_blocks * bs - rng.choice([0, 0, 1, 2])  # often on a boundary
            reqs.append(TraceRequest(0.0, tokens, 1, ids))
        bound = infinite_hit_rate(reqs, bs)
        best = max(_round_robin_infinite(list(order), bs, 1) for order in itertools.permutations(reqs))
        assert best <= bound + 1e-12


def test_a_simulator_waiting_for_replies_does_not_beat_the_infinite_cache_bound(tmp_path, capsys):
    """User a's next turn waits for a long reply, so user b's boundary prompt is sent first and stores the
    block the turn then hits: in the trace's order nobody could hit it."""
    trace = tmp_path / "order.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 100, "output_length": 1000, "hash_ids": [10], "user": "a"},
        {"timestamp": 1, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3], "user": "a"},
        {"timestamp": 2, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2], "user": "b"},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from kvmesh.deployments.cli import main

    out = tmp_path / "sim.json"
    args = ["simulate", "--trace", str(trace), "--replicas", "1", "--capacity-blocks", "100"]
    assert main([*args, "--policies", "round_robin,kvmesh", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for name, m in doc["policies"].items():
        assert m["hit_rate_tokens"] <= doc["bounds"]["global_infinite"] + 1e-12, name
        assert m["hit_rate_tokens"] <= doc["bounds"]["merged_lru"] + 1e-12, name


def test_the_records_infinite_bound_is_the_simulators_in_any_order_warm_up_included():
    """`kvmesh trace bounds` and the live benches judge replays (sent closed-loop, in an order of their own)
    against `record_bounds`: the same order-free bound, the warm-up requests filling the cache first."""
    import itertools

    from kvmesh.cluster.bounds import record_bounds

    rows = [
        {"timestamp": 0, "input_length": 100, "output_length": 1000, "hash_ids": [10]},
        {"timestamp": 1, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 2, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    ]
    got = record_bounds(rows, 512)["infinite"]["hit_rate"]
    reqs = engine_trace(rows, 512).requests
    assert got == pytest.approx(infinite_hit_rate(reqs, 512))
    best = max(_round_robin_infinite(list(order), 512, 1) for order in itertools.permutations(reqs))
    assert got >= best - 1e-12 and got > _round_robin_infinite(reqs, 512, 1)  # beyond the trace's order
    warm = record_bounds(rows, 512, warmup=1)["infinite"]
    assert warm["cached_tokens"] == 1024  # the boundary prompt first stores both blocks the other then hits
    rows[0].update(hash_ids=[1], input_length=600)  # now the warm-up stores block 1: both counted requests hit it
    assert record_bounds(rows, 512, warmup=1)["infinite"]["cached_tokens"] == 1024 + 512

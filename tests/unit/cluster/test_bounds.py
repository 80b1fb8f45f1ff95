"""The balance-bounded bound: between round robin over unbounded caches and the infinite cache, within
its imbalance where that is feasible, trading hit rate for balance where affinity piles work up, and
reported by `kvmesh simulate`."""

from __future__ import annotations

import json
import random

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


def _reference_bounded_affinity(requests, block_size, replicas, max_imbalance, mean_floor) -> dict:
    """The greedy pass as first written, scoring every replica for every request: what
    `bounds._bounded_affinity`, which scores one replica per group of equal hits, must reproduce."""
    held = [set() for _ in range(replicas)]
    prefill = [0] * replicas
    hit = total = fallbacks = 0
    for r in requests:
        n, ids = r.input_length, r.hash_ids
        hits = [cached_tokens(leading_held(ids, h), n, block_size) for h in held]
        fleet = sum(prefill)
        best = None
        for j in range(replicas):
            extra = n - hits[j]
            cap = max_imbalance * max((fleet + extra) / replicas, mean_floor)
            if prefill[j] + extra <= cap * (1 + 1e-9):
                key = (-hits[j], prefill[j], j)
                best = key if best is None or key < best else best
        if best is None:
            fallbacks += 1
            j = min(range(replicas), key=lambda k: (prefill[k] + n - hits[k], -hits[k], k))
        else:
            j = best[2]
        hit += hits[j]
        total += n
        prefill[j] += n - hits[j]
        held[j].update(ids[: cacheable_blocks(n, len(ids), block_size)])
    mean = sum(prefill) / replicas
    return {
        "hit_rate": hit / total if total else 0.0,
        "imbalance": max(prefill) / mean if mean else 1.0,
        "per_replica_prefill": prefill,
        "fallbacks": fallbacks,
    }


def _random_workload(rng, block_size, prefix_ids: bool, zero_tokens: bool) -> list[TraceRequest]:
    """Prompts that branch off each other's prefixes, a shared system prompt in some (every replica comes to
    hold it), lengths that end inside, on, or before their blocks; without `prefix_ids`, some requests draw
    arbitrary ids (repeats, a block after different parents) partway through."""
    system = list(range(10_000, 10_000 + rng.randint(0, 3)))
    paths: list[list[int]] = []
    next_id = 1
    out = []
    for i in range(rng.randint(1, 60)):
        if not prefix_ids and rng.random() < 0.3:
            ids = [rng.randint(1, 12) for _ in range(rng.randint(0, 5))]
        else:
            base = rng.choice(paths)[: rng.randint(0, 6)] if paths and rng.random() < 0.7 else list(system)
            ids = base + list(range(next_id, next_id + rng.randint(0, 3)))
            next_id += 4
            paths.append(ids)
        tokens = max(1, len(ids) * block_size - rng.randint(0, 2 * block_size))
        if zero_tokens and rng.random() < 0.1:
            tokens = 0
        out.append(TraceRequest(float(i), tokens, 1, ids))
    return out


def test_the_greedy_pass_places_every_request_as_scoring_every_replica_does():
    """`_bounded_affinity` scores only one replica per group holding equally many of the request's blocks; on
    random workloads (prefix ids or not, any fleet size, limit and floor) every pass matches the reference
    that scores them all: the same placement's prefill per replica, hit rate, imbalance and fallbacks."""
    from kvmesh.cluster.bounds import _bounded_affinity

    bs = 4
    for seed in range(400):
        rng = random.Random(seed)
        limit = rng.choice([1.0, 1.05, 1.1, 1.25, 2.0, float("inf")])
        # zero-token prompts with no limit are where the reference read inf x 0 as NaN; checked on their own
        reqs = _random_workload(rng, bs, prefix_ids=seed % 3 != 0, zero_tokens=limit != float("inf"))
        replicas = rng.choice([1, 2, 3, 5, 8, 13, 40])
        prompt = sum(r.input_length for r in reqs)
        floor = rng.choice([0.0, prompt / replicas / 2, prompt / replicas])
        want = _reference_bounded_affinity(reqs, bs, replicas, limit, floor)
        assert _bounded_affinity(reqs, bs, replicas, limit, floor) == want, (seed, replicas, limit, floor)


def test_the_bound_over_a_chat_trace_is_the_reference_greedys():
    from kvmesh.cluster import bounds

    trace = engine_trace(synth_chat(ChatSpec(tenants=2, groups=3, users=8, turns=5, seed=7)), 32)
    got = balance_bounded_bound(trace.requests, 32, 6)
    original = bounds._bounded_affinity
    try:
        bounds._bounded_affinity = _reference_bounded_affinity
        want = balance_bounded_bound(trace.requests, 32, 6)
    finally:
        bounds._bounded_affinity = original
    assert got == want


def test_zero_token_prompts_need_no_fallback_without_a_limit():
    """Nothing computed anywhere is within any limit: with max_imbalance inf the cap was inf x 0 = NaN, no
    replica was allowed and every zero-token prompt counted as a fallback."""
    reqs = [TraceRequest(0.0, 0, 1, [1]), TraceRequest(1.0, 0, 1, [1])]
    for limit in (float("inf"), 1.1):
        b = balance_bounded_bound(reqs, 4, 2, max_imbalance=limit)
        assert b["fallbacks"] == 0 and b["hit_rate"] == 0.0 and b["imbalance"] == 1.0, limit


def test_a_pass_scores_replicas_per_group_of_equal_hits_not_the_whole_fleet(monkeypatch):
    """`kvmesh simulate` computes the bound on every run; scoring every replica for every request made it
    requests x replicas x passes (minutes at 4,096 replicas, hours at the documented scales). Counted in
    scorings, not seconds: each request scores at most one replica per count of its blocks held, plus one
    holding none, whatever the fleet's size."""
    from kvmesh.cluster import bounds

    scored = []
    monkeypatch.setattr(bounds, "cached_tokens", lambda *a: scored.append(a) or cached_tokens(*a))
    system = list(range(1000, 1004))  # every request starts with it, so every replica used comes to hold it
    reqs = [TraceRequest(float(i), 7 * 4 + 1, 1, system + [10 * i + k for k in range(3)]) for i in range(30)]
    for replicas in (1, 5, 20_000):
        scored.clear()
        b = balance_bounded_bound(reqs, 4, replicas)
        assert len(scored) <= b["passes"] * sum(len(r.hash_ids) + 1 for r in reqs), replicas

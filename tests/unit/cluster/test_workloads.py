"""Synthetic workloads (cluster/workloads.py) and `kvmesh trace`: structure, determinism, bounds."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.cluster.bounds import record_bounds
from kvmesh.cluster.trace import TraceError, check_record, read_records
from kvmesh.deployments.cli import main as cli


def test_chat_is_deterministic_and_seed_dependent():
    spec = wl.ChatSpec(tenants=2, groups=2, users=3, turns=3, seed=7)
    assert wl.synth_chat(spec) == wl.synth_chat(spec)
    other = wl.synth_chat(wl.ChatSpec(tenants=2, groups=2, users=3, turns=3, seed=8))
    assert other != wl.synth_chat(spec)


def test_chat_structure_history_grows_and_groups_share_system_prompt():
    spec = wl.ChatSpec(tenants=2, groups=2, users=3, turns=4, system_blocks=5, seed=1)
    recs = wl.synth_chat(spec)
    assert len(recs) == 2 * 2 * 3 * 4
    for i, r in enumerate(recs):
        check_record(r, f"record {i}")
    assert [r["timestamp"] for r in recs] == sorted(r["timestamp"] for r in recs)
    wl.check_parent_rule(recs)
    by_user: dict[str, list[dict]] = {}
    for r in recs:
        by_user.setdefault(r["user"], []).append(r)
    assert len(by_user) == 12
    for user, turns in by_user.items():
        assert len(turns) == 4
        for prev, nxt in zip(turns, turns[1:]):  # each turn carries the whole previous prompt
            assert nxt["hash_ids"][: len(prev["hash_ids"])] == prev["hash_ids"]
            assert len(nxt["hash_ids"]) > len(prev["hash_ids"])
    systems = {}
    for r in recs:
        group = r["user"].rsplit("-", 1)[0]
        systems.setdefault(group, set()).add(tuple(r["hash_ids"][:5]))
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per group
    assert len({next(iter(s)) for s in systems.values()}) == 4  # and groups differ
    tenants_of_ids: dict[int, set] = {}
    for r in recs:
        for i in r["hash_ids"]:
            tenants_of_ids.setdefault(i, set()).add(r["tenant"])
    assert all(len(t) == 1 for t in tenants_of_ids.values())  # no id crosses tenants


def test_turns_interleave_across_users():
    recs = wl.synth_chat(wl.ChatSpec(tenants=1, groups=1, users=4, turns=4, seed=3))
    users = [r["user"] for r in recs]
    switches = sum(a != b for a, b in zip(users, users[1:]))
    assert switches > 4  # not four blocks of one user each


def test_flood_shares_one_system_prompt():
    recs = wl.synth_flood(requests=10, system_blocks=4, unique_blocks=2, interval_ms=10)
    assert len(recs) == 10
    assert len({tuple(r["hash_ids"][:4]) for r in recs}) == 1
    assert len({tuple(r["hash_ids"][4:]) for r in recs}) == 10
    assert [r["timestamp"] for r in recs] == [i * 10 for i in range(10)]
    wl.check_parent_rule(recs)


def test_parent_rule_violation_is_detected():
    with pytest.raises(ValueError, match="follows"):
        wl.check_parent_rule([{"hash_ids": [1, 2]}, {"hash_ids": [3, 2]}])


def test_scaled_lengths_keep_partial_tail():
    rec = {"timestamp": 0, "input_length": 2 * 512 + 256, "output_length": 100, "hash_ids": [1, 2, 3]}
    assert wl.scaled_block_lengths(rec, 32) == [32, 32, 16]
    rec["input_length"] = 3 * 512
    assert wl.scaled_block_lengths(rec, 32) == [32, 32, 32]
    rec["input_length"] = 2 * 512 + 1
    assert wl.scaled_block_lengths(rec, 32) == [32, 32, 1]
    assert wl.scaled_output_length(rec, 32) == 6


def _rec(ids, length=None):
    return {"timestamp": 0, "input_length": length or len(ids) * 512, "output_length": 1, "hash_ids": ids}


def test_bounds_by_hand():
    # a: 3 full blocks; b shares 2 then new; c repeats a exactly (last token never cached)
    recs = [_rec([1, 2, 3]), _rec([1, 2, 4]), _rec([1, 2, 3])]
    b = record_bounds(recs, tokens_per_block=32, replicas=2)
    assert b["prompt_tokens"] == 3 * 96
    assert b["infinite"]["cached_tokens"] == 0 + 64 + 64
    # round robin over 2: a->0, b->1 (cold), c->0 (sees a)
    assert b["round_robin_infinite"]["cached_tokens"] == 64
    # finer engine blocks inside a trace block: the last-token cap now costs one 16-token block only
    b16 = record_bounds(recs, tokens_per_block=32, block_size=16, replicas=1)
    assert b16["infinite"]["cached_tokens"] == 64 + 80


def test_bounds_partial_block_is_not_cached_but_later_full_use_shares():
    recs = [_rec([1, 2], 512 + 256), _rec([1, 2, 3], 3 * 512)]
    b = record_bounds(recs, tokens_per_block=32, block_size=16)
    # first: 32 + 16 tokens, all three 16-token engine blocks stored; the second hits all of them
    assert b["infinite"]["cached_tokens"] == 32 + 16


def test_bounds_salt_by_tenant_and_warmup():
    recs = [dict(_rec([1, 2]), tenant="a"), dict(_rec([1, 2, 3]), tenant="b"), dict(_rec([1, 2, 3]), tenant="a")]
    assert record_bounds(recs, 32)["infinite"]["cached_tokens"] == 64  # only a's second request
    assert record_bounds(recs, 32, salt_by_tenant=False)["infinite"]["cached_tokens"] == 64 + 64
    warm = record_bounds(recs, 32, warmup=2)
    assert warm["requests"] == 1 and warm["prompt_tokens"] == 96 and warm["infinite"]["cached_tokens"] == 64


def test_tenant_salt_is_the_tenant_a_request_carries():
    """Requests carry their tenant as a string (`TraceRequest.tenant`): tenants 1 and "1" are one tenant,
    so they share one salt, and share their blocks."""
    recs = [dict(_rec([1, 2]), tenant=1), dict(_rec([1, 2, 3]), tenant="1")]
    trace = wl.engine_trace(recs, 32)
    assert [r.tenant for r in trace.requests] == ["1", "1"]
    assert trace.requests[1].hash_ids[:2] == trace.requests[0].hash_ids[:2]


def test_bounds_reject_misaligned_blocks():
    with pytest.raises(ValueError, match="multiple"):
        record_bounds([_rec([1])], tokens_per_block=48, block_size=32)


def test_bundled_conversation_matches_published_bound():
    recs = read_records("conversation")
    b = record_bounds(recs, 512, warmup=len(recs) // 2)
    # published: 39.8% over the second half (counting partial blocks, which we do not)
    assert 0.39 <= b["infinite"]["hit_rate"] <= 0.398


def test_a_timestamp_that_is_not_finite_is_refused():
    """JSON as Python reads it accepts Infinity; a replay at the trace's timestamps then sleeps forever."""
    for bad in (float("inf"), float("nan"), 1e400):
        with pytest.raises(TraceError, match="timestamp"):
            check_record({"timestamp": bad, "input_length": 1, "output_length": 1, "hash_ids": [1]}, "line 1")


def test_check_record_errors():
    with pytest.raises(TraceError, match=r"line 3: missing field\(s\) hash_ids"):
        check_record({"timestamp": 0, "input_length": 1, "output_length": 1}, "line 3")
    with pytest.raises(TraceError, match="does not fit"):
        check_record(_rec([1, 2], 100), "x")
    with pytest.raises(TraceError, match="non-empty list"):
        check_record({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []})


def test_read_records_keeps_extra_keys_and_names_the_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    wl.write_jsonl([dict(_rec([1, 2]), tenant="a", user="u")], path)
    assert read_records(path) == [dict(_rec([1, 2]), tenant="a", user="u")]
    path.write_text(path.read_text() + "\n" + json.dumps(_rec([1, 2], 2000)) + "\n")
    with pytest.raises(TraceError, match="t.jsonl line 3: input_length 2000 does not fit"):
        read_records(path)
    assert len(read_records(path, limit=1)) == 1


def test_fit_context():
    recs = [_rec([1]), _rec([1, 2, 3])]
    assert wl.fit_context(recs, 32, 64) == [recs[0]]


def test_cli_synth_flood_bounds(tmp_path, capsys):
    out = tmp_path / "chat.jsonl"
    assert (
        cli(
            [
                "trace",
                "synth",
                "--out",
                str(out),
                "--tenants",
                "1",
                "--groups",
                "2",
                "--users",
                "2",
                "--turns",
                "3",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 12 and all("tenant" in r and "user" in r for r in lines)
    assert lines == wl.synth_chat(wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, seed=5))
    flood = tmp_path / "flood.jsonl"
    assert cli(["trace", "flood", "--out", str(flood), "--requests", "5"]) == 0
    assert len(flood.read_text().splitlines()) == 5
    res = tmp_path / "b.json"
    assert (
        cli(["trace", "bounds", "--trace", str(out), "--tokens-per-block", "32", "--replicas", "2", "--json", str(res)])
        == 0
    )
    data = json.loads(res.read_text())
    assert data == {"trace": "chat.jsonl", "limit": None, **record_bounds(lines, 32, replicas=2)}
    assert "infinite cache" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trace", "synth", "--out", "x.jsonl", "--users", "0"], "must be >= 1"),
        (["trace", "synth", "--out", "x.jsonl", "--user-blocks", "3-1"], "MIN <= MAX"),
        (["trace", "bounds", "--trace", "/nonexistent/t.jsonl"], "no such file"),
        (["trace", "bounds", "--trace", "BAD", "--tokens-per-block", "48", "--block-size", "32"], None),
        (["trace"], "required"),
        (["trace", "bounds", "--trace", "conversation", "--warmup", "-5"], "--warmup: must be >= 0, got -5"),
        (["trace", "bounds", "--trace", "EMPTY"], "no requests"),
        (["trace", "bounds", "--trace", "TENANT"], "field 'tenant' must be a string, a finite number or null"),
        (["trace", "synth", "--out", "x.jsonl", "--think-ms", "9" * 330], "--think-ms: must be <= 1,000,000,000,000"),
        (["trace", "synth", "--out", "x.jsonl", "--start-spread-ms", "-1"], "--start-spread-ms: must be >= 0"),
        (
            ["trace", "synth", "--out", "x.jsonl", "--system-blocks", "1000000000"],
            "--system-blocks: must be <= 100,000",
        ),
        (["trace", "synth", "--out", "x.jsonl", "--user-blocks", "1-1000000000"], "MAX must be <= 100,000"),
        (
            "trace synth --out x.jsonl --tenants 100000 --groups 100000 --users 100000 --turns 100000".split(),
            "100,000,000,000,000,000,000 requests, more than 100,000,000",
        ),
        (["trace", "synth", "--out", "x.jsonl", "--turns", "100000"], "hash ids, more than 10,000,000,000"),
        (["trace", "flood", "--out", "x.jsonl", "--requests", "1000000000"], "--requests: must be <= 100,000,000"),
        (["trace", "flood", "--out", "x.jsonl", "--system-blocks", "1000000000"], "--system-blocks: must be <="),
        (["trace", "flood", "--out", "x.jsonl", "--interval-ms", "inf"], "--interval-ms: must be a finite number"),
        (["trace", "flood", "--out", "x.jsonl", "--interval-ms", "1e307"], "--interval-ms: must be <= 1e+12"),
    ],
)
def test_cli_errors_are_one_line_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a trace that was wrongly written lands here
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "tenant.jsonl").write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], "tenant": {"a": 1}}\n'
    )
    argv = [{"EMPTY": "empty.jsonl", "TENANT": "tenant.jsonl"}.get(a, a) for a in argv]
    if "BAD" in argv:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnot json\n')
        argv = [str(bad) if a == "BAD" else a for a in argv]
        message = "bad.jsonl line 2: not valid JSON"
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err
    assert not (tmp_path / "x.jsonl").exists()


def test_a_million_request_chat_trace_is_within_the_limits(tmp_path, monkeypatch):
    """The limits leave the common large trace alone: checked without writing its million lines."""
    written = []
    monkeypatch.setattr(wl, "write_jsonl", lambda records, path, progress=False: written.append(path) or 0)
    monkeypatch.setattr(wl, "ChatRecords", lambda spec: [])
    argv = "trace synth --tenants 20 --groups 10 --users 625 --turns 8 --out".split() + [str(tmp_path / "m.jsonl")]
    assert cli(argv) == 0 and written == [str(tmp_path / "m.jsonl")]


def test_conversation_slice_keeps_whole_conversations_in_context():
    recs = read_records("conversation")
    sl = wl.conversation_slice(recs, conversations=6, min_turns=3, tokens_per_block=32, max_prompt_tokens=1500)
    users = {}
    for r in sl:
        users.setdefault(r["user"], []).append(r)
        assert sum(wl.scaled_block_lengths(r, 32)) <= 1500
    assert len(users) == 6 and all(len(v) >= 3 for v in users.values())
    assert [r["timestamp"] for r in sl] == sorted(r["timestamp"] for r in sl)
    for turns in users.values():  # one conversation: same first two ids, reuse across turns
        assert len({tuple(t["hash_ids"][:2]) for t in turns}) == 1
    b = record_bounds(sl, 32, replicas=2)
    assert b["infinite"]["hit_rate"] > b["round_robin_infinite"]["hit_rate"] > 0


def test_demo_simulated_kvmesh_beats_round_robin(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert cli(["demo", "--simulate", "--conversations", "8", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "simulated"
    k, rr = doc["results"]["kvmesh"], doc["results"]["round_robin"]
    assert k["uncached_prompt_tokens"] < rr["uncached_prompt_tokens"]
    assert k["hit_rate_tokens"] >= 0.9 * doc["bounds"]["infinite"]["hit_rate"]
    text = capsys.readouterr().out
    assert "kvmesh" in text and "round_robin" in text and "infinite cache" in text


def test_engine_trace_decodes_what_a_replay_asks_for():
    """`kvmesh replay` asks each request for min(--max-tokens, scaled output length) tokens; `engine_trace` with
    the same `max_tokens` decodes as many, without it the whole scaled output length, as before."""
    recs = [dict(_rec([1, 2]), output_length=1024), dict(_rec([1, 2, 3]), output_length=128)]  # 64 and 8 at 32
    assert [r.output_length for r in wl.engine_trace(recs, 32).requests] == [64, 8]
    capped = wl.engine_trace(recs, 32, max_tokens=16)
    assert [r.output_length for r in capped.requests] == [16, 8] and capped.meta["max_tokens"] == 16
    assert [wl.replayed_output_length(r, 32, 16) for r in recs] == [16, 8]
    with pytest.raises(ValueError, match="max_tokens"):
        wl.engine_trace(recs, 32, max_tokens=0)


# ------------------------------------------------------------- streamed generation, the same bytes as before
def _chat_as_first_written(spec: wl.ChatSpec) -> list[dict]:
    """synth_chat as it was before records were made one at a time (every record held, then sorted): the
    reference the streamed records must equal, byte for byte once written."""
    rng = random.Random(spec.seed)
    ids = wl.FreshIds()
    records: list[dict] = []
    for t in range(spec.tenants):
        tenant = f"t{t}"
        for g in range(spec.groups):
            system = ids.take(spec.system_blocks)
            for u in range(spec.users):
                user = f"{tenant}-g{g}-u{u}"
                history = list(system)
                clock = rng.uniform(0, spec.start_spread_ms)
                for _turn in range(spec.turns):
                    message = ids.take(rng.randint(*spec.user_blocks))
                    prompt = history + message
                    tail = rng.randint(512 // 8, 512)
                    reply = ids.take(rng.randint(*spec.reply_blocks))
                    records.append(
                        {
                            "timestamp": int(clock),
                            "input_length": (len(prompt) - 1) * 512 + tail,
                            "output_length": len(reply) * 512,
                            "hash_ids": prompt,
                            "tenant": tenant,
                            "user": user,
                        }
                    )
                    history = prompt + reply
                    clock += spec.think_ms * rng.uniform(0.5, 1.5)
    records.sort(key=lambda r: (r["timestamp"], r["user"]))
    return records


CHAT_SHAPES = [
    {},
    # every request at time 0: the order is the users' names alone ("t10-..." before "t2-...")
    {"tenants": 12, "groups": 11, "users": 13, "turns": 2, "start_spread_ms": 0, "think_ms": 0},
    # a user's turns at one timestamp, and many users at each: ties of (timestamp, user) keep turn order
    {"tenants": 3, "groups": 2, "users": 25, "turns": 3, "start_spread_ms": 5, "think_ms": 1},
    {"tenants": 1, "groups": 1, "users": 1, "turns": 9, "system_blocks": 1, "user_blocks": (1, 5)},
    {"tenants": 2, "groups": 3, "users": 4, "turns": 5, "reply_blocks": (3, 3), "think_ms": 7},
]


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
@pytest.mark.parametrize("shape", CHAT_SHAPES, ids=range(len(CHAT_SHAPES)))
def test_streamed_chat_records_write_the_same_bytes_as_the_whole_list(tmp_path, shape, seed):
    spec = wl.ChatSpec(**shape, seed=seed)
    reference = _chat_as_first_written(spec)
    streamed = wl.ChatRecords(spec)
    assert not isinstance(streamed, list) and len(streamed) == len(reference)
    wl.write_jsonl(reference, tmp_path / "whole.jsonl")
    assert wl.write_jsonl(streamed, tmp_path / "streamed.jsonl") == len(reference)
    assert (tmp_path / "streamed.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    assert wl.synth_chat(spec) == reference


def test_trace_synth_writes_records_as_they_are_made(tmp_path, monkeypatch):
    """`kvmesh trace synth` hands write_jsonl the records unmade (a sized iterable, its count known for the
    progress bar), not a list of them all: 100M requests held whole took ~70 GB."""
    real = wl.write_jsonl
    seen = []

    def write(records, path, progress=False):
        seen.append((isinstance(records, list), len(records)))
        return real(records, path, progress)

    monkeypatch.setattr(wl, "write_jsonl", write)
    argv = "trace synth --tenants 2 --groups 3 --users 4 --turns 5 --seed 3 --out".split()
    assert cli([*argv, str(tmp_path / "c.jsonl")]) == 0
    assert seen == [(False, 120)]
    expected = _chat_as_first_written(wl.ChatSpec(tenants=2, groups=3, users=4, turns=5, seed=3))
    assert [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()] == expected


def test_writing_a_chat_trace_holds_a_few_dozen_bytes_a_request():
    """What writing 40,000 requests holds at its peak (Python's and numpy's allocations, which tracemalloc
    both sees): the list of records took ~0.7 kB a request (~28 MB here); made as written, a few dozen
    bytes a request and one 65,536-record chunk of the order, a few MB."""
    import numpy  # noqa: F401  (imported before tracing: its import is not the records' memory)

    spec = wl.ChatSpec(tenants=10, groups=10, users=100, turns=4)
    tracemalloc.start()
    try:
        for _ in wl.ChatRecords(spec):
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12_000_000, peak


def test_flood_records_are_made_one_at_a_time_and_equal_the_list():
    records = wl.flood_records(requests=50, system_blocks=3, unique_blocks=2, interval_ms=7.5, seed=4)
    assert not isinstance(records, list)
    assert list(records) == wl.synth_flood(requests=50, system_blocks=3, unique_blocks=2, interval_ms=7.5, seed=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        wl.flood_records(requests=0)  # refused at the call, before any record is asked for

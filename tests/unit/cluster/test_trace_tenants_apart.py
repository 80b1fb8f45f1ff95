"""Tenants never share a simulated block, whichever way a trace is read: live, kvmesh salts each tenant's block
hashes, so two tenants' equal trace ids are different blocks. `kvmesh simulate` without `--tokens-per-block`
(`load_trace`) once keyed blocks by the raw ids and let tenants share them, reporting a bound above what
`kvmesh trace bounds` and the `--tokens-per-block` path (`engine_trace`) gave for the same trace."""

from __future__ import annotations

import json

import pytest

from kvmesh.cluster.bounds import compute_bounds, record_bounds
from kvmesh.cluster.trace import MAX_HASH_ID, load_trace, read_records, tenant_block_ids
from kvmesh.cluster.workloads import ChatSpec, engine_trace, synth_chat


def _rec(ts, ids, tenant=None):
    rec = {"timestamp": ts, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids}
    return rec if tenant is None else dict(rec, tenant=tenant)


# two tenants with the same four-block system prompt (ids 1-4), each with a question of its own
CLASH = [
    _rec(0, [1, 2, 3, 4, 100], "t0"),
    _rec(100, [1, 2, 3, 4, 101], "t1"),
    _rec(200, [1, 2, 3, 4, 102], "t0"),
    _rec(300, [1, 2, 3, 4, 103], "t1"),
]


def _write(tmp_path, records, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_first_tenant_keeps_an_id_and_another_gets_one_of_its_own():
    out = tenant_block_ids(["t0", "t1", "t0", "t1"], [r["hash_ids"] for r in CLASH])
    assert out[0] == [1, 2, 3, 4, 100] and out[2] == [1, 2, 3, 4, 102]  # t0 used 1-4 first: kept
    t1 = out[1][:4]
    assert t1 == out[3][:4]  # the same fresh ids wherever t1 uses them: t1 still shares with itself
    assert not set(t1) & set(out[0])  # and never with t0
    assert min(t1) > 103 and max(t1) <= MAX_HASH_ID  # above every id of the trace
    assert out[1][4] == 101 and out[3][4] == 103  # an id only t1 uses stays


NESTED = [[1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]]  # one conversation's turns
DISJOINT = [[10 * k + j for j in range(3)] for k in range(4)]


@pytest.mark.parametrize(
    "tenants, lists",
    [([None] * 4, NESTED), (["t0"] * 4, NESTED), (["t0", "t1", "t2", "t3"], DISJOINT)],
    ids=["no tenant", "one tenant", "tenants on disjoint ids"],
)
def test_a_trace_whose_tenants_share_no_id_keeps_every_id(tenants, lists):
    out = tenant_block_ids(tenants, lists)
    assert all(a is b for a, b in zip(out, lists, strict=True))


def test_a_record_without_a_tenant_is_apart_from_a_tenants():
    """Live, a request without a tenant is unsalted, a tenant's salted: their blocks differ."""
    out = tenant_block_ids([None, "t0"], [[1, 2], [1, 2]])
    assert out[0] == [1, 2] and not set(out[1]) & {1, 2}


def test_a_generated_chat_trace_keeps_its_ids():
    """Generated tenants never share an id (one id counter for all), so their traces read as they did."""
    recs = synth_chat(ChatSpec(tenants=3, users=2, turns=3))
    lists = [r["hash_ids"] for r in recs]
    assert tenant_block_ids([r["tenant"] for r in recs], lists) == lists


def test_load_trace_keeps_tenants_apart(tmp_path):
    trace = load_trace(str(_write(tmp_path, CLASH)))
    a, b = trace.requests[0].hash_ids, trace.requests[1].hash_ids
    assert a[:4] == [1, 2, 3, 4] and not set(a) & set(b)


def test_simulate_and_trace_bounds_agree_on_a_trace_whose_tenants_share_ids(tmp_path):
    """The infinite bound of the default read equals the one `kvmesh trace bounds` and `--tokens-per-block 512`
    give: each tenant hits its own system prompt from its second request on, never the other's."""
    path = _write(tmp_path, CLASH)
    default = load_trace(str(path))
    expanded = engine_trace(read_records(path), 512, 512)
    plain = compute_bounds(default.requests, 512, 2, 100)["global_infinite"]
    assert plain == pytest.approx(compute_bounds(expanded.requests, 512, 2, 100)["global_infinite"])
    assert plain == pytest.approx(record_bounds(read_records(path), 512)["infinite"]["hit_rate"])
    assert plain == pytest.approx(2 * 4 * 512 / (4 * 5 * 512))  # the second request of each tenant hits 4 blocks


def test_engine_trace_numbers_blocks_as_before_when_tenants_share_ids():
    """`engine_trace` keys its blocks by (tenant, id, part) through the shared rule: blocks are numbered in the
    order they first appear, so its traces are those it made before the rule was shared."""
    trace = engine_trace(CLASH, 64, 32)
    assert trace.requests[0].hash_ids == list(range(1, 11))
    assert trace.requests[1].hash_ids == list(range(11, 21))
    assert trace.requests[2].hash_ids == list(range(1, 9)) + [21, 22]

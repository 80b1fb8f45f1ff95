"""PrefixIndex: prefix matching per tier, events, speculation, LRU bound, stale replicas.

The property test checks `match` against a deliberately naive model (per-replica sets walked one
replica at a time), so a wrong bitmask shortcut cannot hide."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cluster.index import PrefixIndex, event_hash


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(**kw):
    idx = PrefixIndex(**kw)
    idx.add_replica("a", "n1")
    idx.add_replica("b", "n1")
    idx.add_replica("c", "n2")
    return idx


def test_hbm_prefix_stops_at_first_gap():
    idx = make()
    idx.store("a", [1, 2, 3, 5])
    idx.store("b", [1])
    m = idx.match([1, 2, 3, 4, 5])
    assert m["a"] == (3, 3, 3)
    assert m["b"] == (1, 1, 1)
    assert m["c"] == (0, 0, 0)


def test_host_tier_is_per_node_and_shared_is_global():
    idx = make()
    idx.store("a", [1, 2])  # a: hbm 2
    idx.store("a", [3, 4], tier="host")  # node n1: blocks 3,4
    idx.store_shared([5])
    m = idx.match([1, 2, 3, 4, 5, 6])
    assert m["a"] == (2, 4, 5)
    # b is on n1: no hbm block 1, so hbm 0; host tier of n1 has 3,4 but not 1 -> host prefix 0;
    # shared has only 5 -> any prefix 0
    assert m["b"] == (0, 0, 0)
    idx.store_host("n1", [1, 2])
    m = idx.match([1, 2, 3, 4, 5, 6])
    assert m["b"] == (0, 4, 5)
    assert m["c"] == (0, 0, 0)
    idx.store_shared([1, 2, 3, 4])
    assert idx.match([1, 2, 3, 4, 5, 6])["c"] == (0, 0, 5)


def test_match_reports_every_replica_and_counts_lookups():
    idx = make()
    m = idx.match([9, 8])
    assert set(m) == {"a", "b", "c"} and all(v == (0, 0, 0) for v in m.values())
    idx.store("c", [9, 8])
    idx.match([9, 8, 7])
    s = idx.stats
    assert s["lookups"] == 2 and s["lookup_blocks"] == 5 and s["hits"] == 1 and s["hit_blocks"] == 2


def test_remove_and_clear_and_remove_replica():
    idx = make()
    idx.store("a", [1, 2, 3])
    idx.store("b", [1, 2, 3])
    idx.remove("a", [2])
    assert idx.match([1, 2, 3])["a"] == (1, 1, 1)
    idx.clear("b")
    assert idx.match([1, 2, 3])["b"] == (0, 0, 0)
    idx.remove_replica("a")
    assert "a" not in idx.match([1])
    assert len(idx) == 0  # nothing left holds any block
    idx.add_replica("d", "n1")  # reuses a's slot: must not inherit its blocks
    assert idx.match([1, 3])["d"] == (0, 0, 0)


def test_lru_bound_evicts_oldest_and_keeps_recently_matched():
    idx = make(max_blocks=4)
    idx.store("a", [1, 2, 3, 4])
    idx.match([1])  # touch 1
    idx.store("a", [5])  # evicts 4: the chain's tail, the oldest (a chain is touched last-to-first)
    assert len(idx) == 4
    assert idx.stats["evictions"] == 1 and idx.stats["admissions"] == 5
    assert idx.match([1])["a"] == (1, 1, 1)
    assert idx.match([4])["a"] == (0, 0, 0)
    assert idx.match([1, 2, 3])["a"] == (3, 3, 3)
    assert idx.held_blocks("a") == 4


def test_speculation_expires_unless_confirmed():
    clock = FakeClock()
    idx = make(speculative_ttl_s=2.0, clock=clock)
    assert idx.speculate("a", [1, 2, 3]) == 3
    assert idx.match([1, 2, 3])["a"] == (3, 3, 3)
    idx.store("a", [1, 2])  # the engine confirms the first two blocks
    clock.t = 2.5
    assert idx.match([1, 2, 3])["a"] == (2, 2, 2)
    s = idx.stats
    assert s["speculative_writes"] == 3 and s["speculative_confirmed"] == 2
    assert s["speculative_expired"] == 1


def test_respeculation_extends_ttl():
    clock = FakeClock()
    idx = make(speculative_ttl_s=2.0, clock=clock)
    idx.speculate("a", [1])
    clock.t = 1.5
    idx.speculate("a", [1])
    clock.t = 2.5  # first TTL passed, second not yet
    assert idx.match([1])["a"] == (1, 1, 1)
    clock.t = 3.6
    assert idx.match([1])["a"] == (0, 0, 0)


def test_speculation_does_not_touch_confirmed_blocks():
    clock = FakeClock()
    idx = make(clock=clock)
    idx.store("a", [1])
    assert idx.speculate("a", [1, 2]) == 1
    clock.t = 10
    assert idx.match([1, 2])["a"] == (1, 1, 1)


def test_withdraw_takes_back_only_unconfirmed_fresh_speculation():
    idx = make()
    idx.store("a", [1])
    idx.speculate("a", [1, 2, 3])  # another request's speculation of block 2 and 3 ...
    fresh: list = []
    idx.speculate("a", [1, 2, 3, 4, 5], fresh=fresh)
    assert [h for h, _ in fresh] == [2, 3, 4, 5]  # it counts on 2 and 3 too, but they are not its to take back
    idx.store("a", [4])  # block 4 confirmed by an event meanwhile
    assert idx.withdraw("a", fresh) == 1
    assert idx.match([1, 2, 3, 4, 5])["a"] == (4, 4, 4)
    assert idx.stats["speculative_withdrawn"] == 1
    assert idx.withdraw("gone", [1]) == 0


def test_mark_stale_clears_view():
    idx = make()
    idx.store("a", [1, 2])
    idx.mark_stale("a")
    assert idx.is_stale("a")
    assert idx.match([1, 2])["a"] == (0, 0, 0)
    assert idx.stats["replicas_stale"] == 1 and idx.stats["replicas_stale_now"] == 1
    idx.mark_fresh("a")
    assert not idx.is_stale("a")


def test_unknown_replica_and_tier_are_errors():
    idx = make()
    with pytest.raises(KeyError):
        idx.store("zz", [1])
    with pytest.raises(ValueError):
        idx.store("a", [1], tier="l3")
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks=0)


def test_event_hash_accepts_bytes_and_ints():
    full = bytes(range(32))
    assert event_hash(full) == int.from_bytes(full[-8:], "big")
    assert event_hash(2**70 + 5) == 5


# ---------------------------------------------------------------- property test vs a naive model
def naive_match(hbm, host, shared, node_of, hashes):
    out = {}
    for rid, held in hbm.items():

        def prefix(ok):
            n = 0
            for h in hashes:
                if not ok(h):
                    break
                n += 1
            return n

        node = node_of[rid]
        out[rid] = (
            prefix(lambda h: h in held),
            prefix(lambda h: h in held or h in host[node]),
            prefix(lambda h: h in held or h in host[node] or h in shared),
        )
    return out


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "host", "unhost", "shared", "unshared", "clear"]),
        st.sampled_from(["r0", "r1", "r2", "r3"]),
        st.lists(st.integers(0, 12), max_size=6),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.lists(st.integers(0, 12), max_size=10))
def test_match_equals_naive_model(operations, query):
    node_of = {"r0": "n0", "r1": "n0", "r2": "n1", "r3": "n2"}
    idx = PrefixIndex()
    for rid, node in node_of.items():
        idx.add_replica(rid, node)
    hbm = {rid: set() for rid in node_of}
    host = {n: set() for n in ("n0", "n1", "n2")}
    shared: set[int] = set()
    for op, rid, hs in operations:
        if op == "store":
            idx.store(rid, hs)
            hbm[rid] |= set(hs)
        elif op == "remove":
            idx.remove(rid, hs)
            hbm[rid] -= set(hs)
        elif op == "host":
            idx.store(rid, hs, tier="host")
            host[node_of[rid]] |= set(hs)
        elif op == "unhost":
            idx.remove(rid, hs, tier="host")
            host[node_of[rid]] -= set(hs)
        elif op == "shared":
            idx.store_shared(hs)
            shared |= set(hs)
        elif op == "unshared":
            idx.remove_shared(hs)
            shared -= set(hs)
        elif op == "clear":
            idx.clear(rid)
            hbm[rid].clear()
    assert idx.match(query) == naive_match(hbm, host, shared, node_of, query)
    assert len(idx) == len(set().union(*hbm.values(), *host.values(), shared))
    arr = idx.match_arrays(query)
    m = idx.match(query)
    for rid, v in m.items():
        assert tuple(int(x) for x in arr[:, idx.slot_of(rid)]) == v


hbm_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "match"]),
        st.integers(0, 19),
        st.lists(st.integers(0, 12), max_size=8),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(hbm_ops, st.booleans(), st.integers(8, 40))
def test_match_hbm_array_is_match_arrays_hbm_row(operations, tiered, max_blocks):
    """The hbm-only walk answers, counts and touches (LRU order, so later evictions) exactly as the
    three-tier walk; 20 replicas so that masks of more than 8 slots are written too."""
    twins = [PrefixIndex(max_blocks=max_blocks), PrefixIndex(max_blocks=max_blocks)]
    for idx in twins:
        for k in range(20):
            idx.add_replica(f"r{k}", f"n{k // 4}")
        if tiered:  # a host tier in use: the fast walk must fall back to the full one
            idx.store_host("n0", [1, 2])
    full, fast = twins
    for op, k, hs in operations:
        rid = f"r{k}"
        if op == "match":
            assert fast.match_hbm_array(hs, 24).tolist() == full.match_arrays(hs, 24)[0].tolist()
            continue
        for idx in twins:
            if op == "store":
                idx.store(rid, hs)
            elif op == "remove":
                idx.remove(rid, hs)
            else:
                idx.clear(rid)
    assert fast.stats == full.stats
    assert list(fast._entries.items()) == list(full._entries.items())
    assert fast.match_hbm_array([0, 1, 2, 3]).tolist() == full.match_arrays([0, 1, 2, 3])[0].tolist()


def test_match_arrays_columns_follow_slots():
    idx = make()
    idx.store("b", [1, 2])
    idx.store_shared([3])
    arr = idx.match_arrays([1, 2, 3, 4], n_slots=8)
    assert arr.shape == (3, 8)
    assert list(arr[:, idx.slot_of("b")]) == [2, 2, 3]
    assert list(arr[:, idx.slot_of("a")]) == [0, 0, 0]


def test_index_contents_are_invisible_to_the_gc():
    """A million GC-tracked entries made each full collection pause the router ~260 ms."""
    import gc

    idx = make()
    idx.store("a", list(range(1000)))
    idx.store_host("n1", list(range(500, 1500)))
    idx.speculate("b", list(range(10)))
    gc.collect()
    assert not any(gc.is_tracked(e) for e in idx._entries.values())
    assert not any(gc.is_tracked(d) for d in idx._held.values())
    assert not any(gc.is_tracked(d) for d in idx._node_held.values())


def test_one_requests_withdraw_leaves_the_marks_another_request_placed_there_counts_on():
    """Two requests with one prefix go to one replica; the first is cancelled (or moved, or ranked again):
    the second still computes the prefix there, so its speculative marks must stay."""
    idx = make()
    first: list = []
    second: list = []
    idx.speculate("a", [1, 2, 3, 4], fresh=first)
    idx.speculate("a", [1, 2, 3, 4, 5, 6], fresh=second)
    assert idx.withdraw("a", first) == 0
    assert idx.match([1, 2, 3, 4, 5, 6])["a"][0] == 6
    assert idx.withdraw("a", second) == 6
    assert idx.match([1, 2, 3, 4, 5, 6])["a"][0] == 0


def test_a_claim_on_an_earlier_mark_of_a_block_does_not_take_back_a_later_one():
    """Block 1 marked for a request, confirmed, evicted, marked again for another: the first request's
    late withdraw concerns a mark that is gone, not the new one."""
    idx = make()
    early: list = []
    late: list = []
    idx.speculate("a", [1, 2], fresh=early)
    idx.store("a", [1, 2])
    idx.remove("a", [1, 2])
    idx.speculate("a", [1, 2], fresh=late)
    assert idx.withdraw("a", early) == 0
    assert idx.match([1, 2])["a"][0] == 2


def test_marks_expire_as_new_ones_come_even_when_nothing_is_looked_up():
    """A router that only hears its peers' placements never looks anything up: its expired marks must not
    pile up (nor push confirmed blocks out of the index) until the next lookup pays for all of them."""
    clock = FakeClock()
    idx = make(clock=clock)
    for i in range(1000):
        clock.t = i  # far past the time to live of the marks before
        idx.speculate("a", [10 * i, 10 * i + 1])
    assert len(idx._spec_queue) <= 2 and idx.held_blocks("a") <= 4


def test_a_node_that_no_replica_is_on_is_forgotten_with_its_host_tier():
    idx = make()
    for i in range(500):  # an autoscaler's machines: a new node id each
        node = f"node-{i}"
        idx.add_replica(f"r{i}", node)
        idx.store(f"r{i}", [i], tier="host")
        idx.remove_replica(f"r{i}")
        idx.remove_node(node)
    assert set(idx.nodes()) == {n for r in idx.replicas() for n in [idx.node_of(r)]}
    idx.add_replica("new", "node-0")  # a new replica where an old one was: vLLM's offloaded blocks died with it
    assert idx.match([0])["new"] == (0, 0, 0)
    keeps = make()
    keeps.add_replica("x", "n1")
    keeps.add_replica("y", "n1")
    keeps.store("x", [7], tier="host")
    keeps.remove_replica("x")
    keeps.remove_node("n1")  # a replica is still on it: nothing is forgotten
    assert keeps.match([7])["y"] == (0, 1, 1)


# ---------------------------------------------------------------- slot allocation
slot_ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "move"]), st.integers(0, 9), st.integers(0, 5)))


@settings(max_examples=200, deadline=None)
@given(slot_ops)
def test_replicas_and_nodes_take_the_lowest_free_slot(operations):
    """Against a model that scans from 0: a freed slot is reused lowest first, for replicas and nodes."""
    idx = PrefixIndex()
    replica_slot: dict[str, int] = {}
    node_slot: dict[str, int] = {}
    node_of: dict[str, str] = {}

    def lowest_free(used):
        return min(set(range(len(used) + 1)) - set(used.values()))

    for op, r, n in operations:
        rid, node = f"r{r}", f"n{n}"
        if op in ("add", "move") and not (rid in node_of and node_of[rid] == node):
            if rid in node_of:  # moved: it leaves its slot first, and takes the lowest free one
                del replica_slot[rid]
            if node not in node_slot:
                node_slot[node] = lowest_free(node_slot)
            replica_slot[rid] = lowest_free(replica_slot)
            node_of[rid] = node
            idx.add_replica(rid, node)
        elif op == "remove" and rid in node_of:
            old = node_of.pop(rid)
            del replica_slot[rid]
            idx.remove_replica(rid)
            if old not in node_of.values():
                del node_slot[old]
                idx.remove_node(old)
        assert {x: idx.slot_of(x) for x in idx.replicas()} == replica_slot
        assert idx._node_slot == node_slot


def test_slots_freed_in_any_order_are_reused_lowest_first():
    idx = PrefixIndex()
    for i in range(6):
        idx.add_replica(f"r{i}", f"n{i}")
    for i in (4, 1, 3):
        idx.remove_replica(f"r{i}")
        idx.remove_node(f"n{i}")
    for i in (6, 7, 8, 9):
        idx.add_replica(f"r{i}", f"n{i}")
    assert [idx.slot_of(f"r{i}") for i in (6, 7, 8, 9)] == [1, 3, 4, 6]
    assert [idx._node_slot[f"n{i}"] for i in (6, 7, 8, 9)] == [1, 3, 4, 6]


class _Probes(dict):
    """A slot table that counts key probes (`in`, [], get)."""

    probes = 0

    def __contains__(self, key):
        _Probes.probes += 1
        return super().__contains__(key)

    def __getitem__(self, key):
        _Probes.probes += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        _Probes.probes += 1
        return super().get(key, default)


def test_adding_replicas_and_nodes_does_not_scan_the_slots_taken():
    """Taking a slot must not probe every slot below it: that made a fleet's set-up quadratic."""
    idx = PrefixIndex()
    idx._slot_rid, idx._node_name = _Probes(), _Probes()
    _Probes.probes = 0
    n = 2000
    for i in range(n):
        idx.add_replica(f"r{i}", f"n{i}")
    assert [idx.slot_of(f"r{i}") for i in range(n)] == list(range(n))
    assert _Probes.probes <= 4 * n


@pytest.mark.parametrize("lookup", ["match", "match_arrays", "match_hbm_array", "speculate"])
def test_a_full_index_evicts_a_chains_tail_not_its_head(lookup):
    """Stores and lookups touch a request's blocks last-to-first, so the eviction of a full index shortens
    a cached prefix by its last block; taking its first block left every other block of it unreachable."""
    idx = PrefixIndex(max_blocks=12, speculative_ttl_s=60.0)
    idx.add_replica("r0")
    chain_a = [100 + i for i in range(8)]
    idx.store("r0", chain_a)
    if lookup == "speculate":
        idx.speculate("r0", chain_a)  # all confirmed already: touched only
    else:
        getattr(idx, lookup)(chain_a)
    idx.store("r0", [200 + i for i in range(5)])  # 13 entries > 12: one eviction
    assert idx.stats["evictions"] == 1
    assert idx.match(chain_a)["r0"][0] == 7
    assert 107 not in idx._entries


def test_a_speculated_chain_keeps_its_head_longest_and_its_claims_in_order():
    idx = PrefixIndex(max_blocks=6, speculative_ttl_s=60.0)
    idx.add_replica("r0")
    fresh: list = []
    idx.speculate("r0", [1, 2, 3, 4], fresh=fresh)
    assert [h for h, _ in fresh] == [1, 2, 3, 4]
    idx.store("r0", [9, 10, 11])  # 7 entries > 6: the speculated chain's tail goes
    assert idx.match([1, 2, 3, 4])["r0"][0] == 3


def test_a_block_stored_of_another_block_size_is_counted_not_applied(caplog):
    """An engine hashing other block sizes than the router publishes keys no request matches: such events
    are counted apart (and warned of once per replica) instead of filling the index silently."""
    from kvmesh.cluster.kv_events import BlockRemoved, BlockStored

    idx = PrefixIndex(block_size=32)
    idx.add_replica("e0")
    idx.add_replica("e1")
    with caplog.at_level("WARNING", logger="kvmesh.cluster.index"):
        assert idx.apply_events("e0", [BlockStored([1, 2, 3], block_size=16, medium="GPU")]) == 0
        assert idx.apply_events("e0", [BlockStored([4], block_size=16)]) == 0
        assert idx.apply_events("e1", [BlockStored([5], block_size=64)]) == 0
    assert idx.match([1, 2, 3])["e0"][0] == 0 and len(idx) == 0
    assert idx.stats["block_size_mismatch"] == 3 and idx.stats["events_ignored"] == 3
    assert idx.stats["events_applied"] == 0
    warned = [r.getMessage() for r in caplog.records if "blocks of" in r.getMessage()]
    assert len(warned) == 2 and "e0" in warned[0] and "e1" in warned[1]  # once per replica
    # the router's own size, or none given, is applied as before
    assert idx.apply_events("e0", [BlockStored([1, 2], block_size=32), BlockStored([3], parent_block_hash=2)]) == 2
    assert idx.match([1, 2, 3])["e0"][0] == 3
    assert idx.apply_events("e0", [BlockRemoved([3])]) == 1 and idx.stats["block_size_mismatch"] == 3
    unchecked = PrefixIndex()  # no block size given: nothing checked
    unchecked.add_replica("e0")
    assert unchecked.apply_events("e0", [BlockStored([1], block_size=16)]) == 1


def test_native_offload_blocks_are_the_replicas_own_not_its_nodes():
    """vLLM native offloading's CPU (and STORAGE) buffer lives in one engine process: a sibling replica on the
    same node cannot load it, and one replica dropping its copy leaves the other's."""
    from kvmesh.cluster.kv_events import BlockRemoved, BlockStored

    idx = PrefixIndex()
    idx.add_replica("A", "n1")
    idx.add_replica("B", "n1")
    hs = [11, 12, 13, 14]
    idx.apply_events("A", [BlockStored(hs, medium="CPU")])
    m = idx.match(hs)
    assert m["A"] == (0, 4, 4) and m["B"] == (0, 0, 0)
    idx.apply_events("B", [BlockStored(hs, medium="STORAGE")])
    idx.apply_events("A", [BlockRemoved(hs, medium="CPU")])
    m = idx.match(hs)
    assert m["A"] == (0, 0, 0) and m["B"] == (0, 4, 4)
    assert idx.nodes() == ["n1"]  # the replicas' own tiers are not nodes
    idx.mark_stale("B")  # a gap: its offload tier, known from the same events, goes too
    assert idx.match(hs)["B"] == (0, 0, 0) and len(idx) == 0
    idx.apply_events("B", [BlockStored(hs, medium="CPU")])
    idx.remove_replica("B")  # its buffer went with its process
    assert len(idx) == 0 and idx.nodes() == ["n1"]
    idx.add_replica("B", "n1")
    assert idx.match(hs)["B"] == (0, 0, 0)
    idx.store_host("n1", hs)  # the node's host tier (LMCache) still reaches every replica on it
    assert idx.match(hs)["A"] == (0, 4, 4) and idx.match(hs)["B"] == (0, 4, 4)


@pytest.mark.parametrize("write", ["store", "speculate"])
def test_a_full_index_writing_a_chain_keeps_its_own_head_with_others_residency(write):
    """A chain is written last-to-first and evicted from once afterwards: evicting after each new block took
    the chain's own head (LRU-oldest until touched), with B's copy and the shared tier's, then re-added it
    with the writer's bit alone."""
    idx = PrefixIndex(max_blocks=4, speculative_ttl_s=60.0)
    idx.add_replica("A")
    idx.add_replica("B")
    idx.store("B", [1, 2])
    idx.store_shared([1, 2])
    idx.store("A", [10, 11])  # full: LRU order 2, 1, 11, 10 (no lookup here: it would touch 1 and 2)
    getattr(idx, write)("A", [1, 2, 3, 4])
    assert idx.match([1, 2])["B"] == (2, 2, 2)  # as before the write
    assert idx.stats["evictions"] == 2 and 10 not in idx._entries and 11 not in idx._entries
    assert idx.match([1, 2, 3, 4])["A"][0] == 4 and len(idx) == 4


@pytest.mark.parametrize("tier", ["host", "shared"])
def test_a_full_index_writing_a_host_or_shared_chain_keeps_its_own_head(tier):
    idx = PrefixIndex(max_blocks=4)
    idx.add_replica("A", "n0")
    idx.add_replica("B", "n1")
    idx.store("B", [1, 2])
    idx.store("A", [10, 11])
    idx.store("A", [1, 2, 3, 4], tier)
    assert idx.match([1, 2])["B"][0] == 2 and idx.stats["evictions"] == 2


def test_a_host_tier_event_of_another_block_size_is_ignored_without_a_mismatch(caplog):
    """LMCache chunk events (CPU, block_size = its chunk size) and vLLM offloading's placeholder (block_size 0)
    were never GPU prefix blocks of the engine's block size: not a mismatch to count or warn of."""
    from kvmesh.cluster.kv_events import BlockStored

    idx = PrefixIndex(block_size=16)
    idx.add_replica("e0")
    with caplog.at_level("WARNING", logger="kvmesh.cluster.index"):
        assert idx.apply_events("e0", [BlockStored([1, 2], block_size=16, medium="GPU")]) == 1
        assert idx.apply_events("e0", [BlockStored([777], block_size=256, medium="CPU")]) == 0
        assert idx.apply_events("e0", [BlockStored([888], block_size=0, medium="CPU")]) == 0
        assert idx.apply_events("e0", [BlockStored([999], block_size=0, medium="GPU")]) == 0
        assert idx.stats["block_size_mismatch"] == 0 and idx.stats["events_ignored"] == 3
        assert not [r for r in caplog.records if "blocks of" in r.getMessage()]
        assert idx.match([1, 2])["e0"][0] == 2 and 777 not in idx._entries and 888 not in idx._entries
        assert idx.apply_events("e0", [BlockStored([3, 4], block_size=32, medium="GPU")]) == 0
    assert idx.stats["block_size_mismatch"] == 1
    warned = [r.getMessage() for r in caplog.records if "blocks of" in r.getMessage()]
    assert len(warned) == 1 and "e0" in warned[0] and "32" in warned[0]

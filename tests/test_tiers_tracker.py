"""Unit tests: the tier tracker turns LMCache's CPU-medium KV events into host and shared residency."""
from cluster.index import PrefixIndex
from cluster.kv_events import BlockRemoved, BlockStored
from cluster.tier_tracker import TierTracker


def _setup(shared_nodes=("n1", "n2"), cap=None):
    idx = PrefixIndex()
    idx.add_replica("a", "n1")
    idx.add_replica("b", "n2")
    t = TierTracker(idx, shared_capacity_blocks=cap)
    for n in shared_nodes:
        t.set_node_shared(n)
    return idx, t


def test_cpu_store_gives_host_on_node_and_shared_everywhere():
    idx, t = _setup()
    t.apply_events("a", [BlockStored([1, 2, 3], medium="GPU"), BlockStored([1, 2, 3], medium="CPU")])
    m = t.match([1, 2, 3, 4])
    assert m["a"] == (3, 3, 3)
    assert m["b"] == (0, 0, 3)  # other node: only through the shared tier


def test_engine_eviction_keeps_host_copy():
    idx, t = _setup()
    t.apply_events("a", [BlockStored([1, 2], medium="GPU"), BlockStored([1, 2], medium="CPU"),
                         BlockRemoved([1, 2], medium="GPU")])
    assert idx.match([1, 2])["a"] == (0, 2, 2)
    t.apply_events("a", [BlockRemoved([1, 2], medium="CPU")])
    assert idx.match([1, 2])["a"] == (0, 0, 2)  # L1 evicted, L2 still has it


def test_no_shared_tier_on_node_means_host_only():
    idx, t = _setup(shared_nodes=())
    t.apply_events("a", [BlockStored([7, 8], medium="CPU")])
    assert idx.match([7, 8]) == {"a": (0, 2, 2), "b": (0, 0, 0)}


def test_shared_loss_forgets_and_suppresses_until_back():
    idx, t = _setup()
    t.apply_events("a", [BlockStored([1, 2], medium="CPU")])
    t.set_shared_up(False)
    assert idx.match([1, 2])["b"] == (0, 0, 0)
    t.apply_events("a", [BlockStored([5], medium="CPU")])
    assert idx.match([5])["b"] == (0, 0, 0)
    t.set_shared_up(True)
    t.apply_events("a", [BlockStored([6], medium="CPU")])
    assert idx.match([6])["b"] == (0, 0, 1)
    assert t.stats["tier_shared_dropped_on_loss"] == 2


def test_shared_capacity_lru():
    idx, t = _setup(cap=2)
    t.apply_events("a", [BlockStored([1], medium="CPU"), BlockStored([2], medium="CPU"),
                         BlockStored([1], medium="CPU"), BlockStored([3], medium="CPU")])
    assert idx.match([2])["b"] == (0, 0, 0)  # least recently stored went first
    assert idx.match([1])["b"] == (0, 0, 1) and idx.match([3])["b"] == (0, 0, 1)
    assert t.stats["tier_shared_evicted"] == 1


def test_passes_through_index_api():
    idx, t = _setup()
    t.add_replica("c", "n1")
    assert "c" in idx.replicas() and t.node_of("c") == "n1"

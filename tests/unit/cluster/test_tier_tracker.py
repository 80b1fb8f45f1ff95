"""Unit tests: the tier tracker records prefills as host (per node) and shared (global) residency."""

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.kv_events import BlockRemoved, BlockStored
from kvmesh.cluster.tier_tracker import TierTracker


def _setup(shared=True, host_cap=None, shared_cap=None, chunk_blocks=1):
    idx = PrefixIndex()
    idx.add_replica("a", "n1")
    idx.add_replica("a2", "n1")
    idx.add_replica("b", "n2")
    t = TierTracker(idx, chunk_blocks=chunk_blocks, shared_capacity_blocks=shared_cap)
    for n in ("n1", "n2"):
        t.set_node(n, has_shared_tier=shared, host_capacity_blocks=host_cap)
    return idx, t


def test_prefill_gives_host_on_node_and_shared_everywhere():
    idx, t = _setup()
    t.apply_events("a", [BlockStored([1, 2, 3], medium="GPU")])
    assert t.record_prefill("a", [1, 2, 3]) == 3
    m = t.match([1, 2, 3, 4])
    assert m["a"] == (3, 3, 3)
    assert m["a2"] == (0, 3, 3)  # same node: host tier
    assert m["b"] == (0, 0, 3)  # other node: only through the shared tier


def test_engine_eviction_keeps_host_copy():
    idx, t = _setup()
    t.apply_events("a", [BlockStored([1, 2], medium="GPU")])
    t.record_prefill("a", [1, 2])
    t.apply_events("a", [BlockRemoved([1, 2], medium="GPU")])
    assert idx.match([1, 2])["a"] == (0, 2, 2)


def test_only_whole_chunks_are_recorded():
    idx, t = _setup(chunk_blocks=4)
    assert t.record_prefill("a", list(range(10, 20))) == 8
    assert idx.match(list(range(10, 20)))["a"] == (0, 8, 8)
    assert t.record_prefill("a", [99, 98, 97]) == 0


def test_no_shared_tier_means_host_only():
    idx, t = _setup(shared=False)
    t.record_prefill("a", [7, 8])
    assert idx.match([7, 8])["b"] == (0, 0, 0) and idx.match([7, 8])["a"] == (0, 2, 2)


def test_node_without_lmcache_records_nothing():
    idx, t = _setup()
    idx.add_replica("c", "n3")
    assert t.record_prefill("c", [1, 2]) == 0
    assert idx.match([1, 2])["b"] == (0, 0, 0)


def test_host_lru_keeps_parents_longest():
    idx, t = _setup(host_cap=4, shared=False)
    t.record_prefill("a", [1, 2, 3])
    t.record_prefill("a", [1, 2, 5, 6])  # touches 1, 2 again; 3 is least recent now
    assert idx.match([1, 2, 3])["a"] == (0, 2, 2)
    assert idx.match([1, 2, 5, 6])["a"] == (0, 4, 4)
    assert t.stats["tier_host_evicted"] == 1


def test_shared_loss_forgets_and_suppresses_until_back():
    idx, t = _setup()
    t.record_prefill("a", [1, 2])
    t.set_shared_up(False)
    assert idx.match([1, 2])["b"] == (0, 0, 0)
    assert idx.match([1, 2])["a"] == (0, 2, 2)  # the node's own L1 still has them
    t.record_prefill("a", [5])
    assert idx.match([5])["b"] == (0, 0, 0)
    t.set_shared_up(True)
    t.record_prefill("a", [6])
    assert idx.match([6])["b"] == (0, 0, 1)
    assert t.stats["tier_shared_dropped_on_loss"] == 2


def test_restarted_node_loses_host_tier():
    idx, t = _setup(shared=False)
    t.record_prefill("a", [1, 2])
    t.node_restarted("n1")
    assert idx.match([1, 2])["a"] == (0, 0, 0)


def test_shared_capacity_lru():
    idx, t = _setup(shared_cap=2)
    t.record_prefill("a", [1])
    t.record_prefill("a", [2])
    t.record_prefill("a", [1])
    t.record_prefill("a", [3])
    assert idx.match([2])["b"] == (0, 0, 0)
    assert idx.match([1])["b"] == (0, 0, 1) and idx.match([3])["b"] == (0, 0, 1)


def test_lmcache_chunk_hash_events_are_dropped_other_events_pass():
    idx, t = _setup()
    t.apply_events("a", [BlockStored([42], medium="CPU"), BlockStored([43], medium="GPU")])
    assert idx.match([42])["a"] == (0, 0, 0)
    assert idx.match([43])["a"] == (1, 1, 1)
    assert t.stats["tier_lmcache_events_dropped"] == 1


def test_passes_through_index_api():
    idx, t = _setup()
    t.add_replica("c", "n1")
    assert "c" in idx.replicas() and t.node_of("c") == "n1"


def test_chunk_blocks_per_node():
    idx, t = _setup()
    t.set_node("n2", has_shared_tier=True, chunk_blocks=2)
    assert t.record_prefill("b", [1, 2, 3]) == 2
    assert t.record_prefill("a", [4, 5, 6]) == 3


def test_watch_tier_health_feeds_tracker(monkeypatch):
    """The router's health task (no Ray: node_servers() faked as our own interface) updates the tracker."""
    import asyncio

    from kvmesh.kvstore import node_server

    idx, t = _setup()
    t.record_prefill("a", [1, 2])
    health = {"n1": {"shared_tier_up": True, "restarts": 0}}
    asked: list[str] = []

    class _Ref:
        def __init__(self, node):
            self.node = node

        def __await__(self):
            async def _get():
                asked.append(self.node)
                return dict(health[self.node])

            return _get().__await__()

    class _Actor:
        def __init__(self, node):
            self.health = type("M", (), {"remote": lambda _self, n=node: _Ref(n)})()

    monkeypatch.setattr(node_server, "node_servers", lambda: {n: _Actor(n) for n in health})

    async def until(done) -> None:  # rounds come every 0.01 s; a busy machine may take longer
        deadline = asyncio.get_running_loop().time() + 30
        while not done():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(node_server.watch_tier_health(t, interval_s=0.01, stop=stop))
        await until(lambda: len(asked) >= 2)  # the first answer (restarts 0) was read: the next round asked
        health["n1"] = {"shared_tier_up": False, "restarts": 1}
        await until(lambda: t.shared_up is False and idx.match([1, 2])["a"] == (0, 0, 0))
        stop.set()
        await task

    asyncio.run(run())
    assert t.shared_up is False
    assert idx.match([1, 2])["b"] == (0, 0, 0)  # shared entries dropped
    assert idx.match([1, 2])["a"] == (0, 0, 0)  # node n1 restarted: host entries dropped


def test_a_prompt_that_leaves_a_stored_one_inside_a_chunk_loads_the_chunks_before():
    # LMCache keys a chunk by every token up to its end: sharing 11 blocks of a stored 16-block prompt in
    # chunks of 4 leaves 8 loadable (the engine's own hbm prefix counts whole, block by block)
    idx, t = _setup(chunk_blocks=4)
    stored = list(range(100, 116))
    t.apply_events("a", [BlockStored(stored[:3], medium="GPU")])
    t.record_prefill("a", stored)
    asked = stored[:11] + [999, 998]
    raw = idx.match(asked)
    assert raw["b"] == (0, 0, 11) and raw["a2"] == (0, 11, 11)
    m = t.loadable(raw)
    assert m["b"] == (0, 0, 8)  # shared tier, whole chunks
    assert m["a2"] == (0, 8, 8)  # host tier on the same node, whole chunks
    assert m["a"] == (3, 8, 8)  # its hbm holds 3, LMCache gives 8
    whole = t.loadable(raw, whole_chunks=False)  # what the tiers hold before the cut: the 11 blocks
    assert whole["b"] == (0, 0, 11) and whole["a2"] == (0, 11, 11) and whole["a"] == (3, 11, 11)
    assert t.loadable(idx.match(stored))["b"] == (0, 0, 16)  # the whole stored prompt: every chunk
    t.apply_events("a", [BlockStored(stored[3:10], medium="GPU")])
    assert t.loadable(idx.match(asked))["a"] == (10, 10, 10)  # its hbm's 10 beat LMCache's 8


def test_what_a_replica_reads_depends_on_its_node_and_the_shared_tier():
    idx, t = _setup()
    idx.add_replica("c", "n3")  # a node without an LMCache server
    t.record_prefill("a", [1, 2, 3])
    assert idx.match([1, 2, 3])["c"] == (0, 0, 3)  # the index's shared tier is global ...
    assert t.loadable(idx.match([1, 2, 3]))["c"] == (0, 0, 0)  # ... but c's engine has no LMCache to load it
    assert t.loadable(idx.match([1, 2, 3]), whole_chunks=False)["c"] == (0, 0, 0)  # with or without chunks
    t.set_shared_up(False)
    t.record_prefill("a", [1, 2, 3])  # only the host tier now
    m = t.loadable(idx.match([1, 2, 3]))
    assert m["b"] == (0, 0, 0) and m["a2"] == (0, 3, 3)


def test_without_lmcache_the_match_is_the_index_own():
    idx = PrefixIndex()
    idx.add_replica("a", "n1")
    t = TierTracker(idx)
    idx.store("a", [1, 2], tier="host")  # an engine's own offload events, not LMCache's
    m = idx.match([1, 2])
    assert t.loadable(m) is m and m["a"] == (0, 2, 2)


def test_tiers_of_unknown_size_are_modelled_no_larger_than_the_index():
    """Nothing says how much a Redis (maxmemory, LRU) or a host tier of unknown size holds: modelled without a
    bound, the router's shadow of them grew with every prefix ever stored, and kept predicting hits for
    blocks the tier had long evicted. The index's own size bounds them; what they drop is an under-estimate."""
    idx = PrefixIndex(max_blocks=50)
    idx.add_replica("a", "n1")
    idx.add_replica("b", "n2")
    t = TierTracker(idx)
    t.set_node("n1", has_shared_tier=True)
    t.set_node("n2", has_shared_tier=True)
    for i in range(40):
        t.record_prefill("a", [1000 * i + k for k in range(4)])
    assert len(t._shared) <= 50 and len(t._host["n1"]) <= 50
    assert t.match([0, 1, 2, 3])["b"] == (0, 0, 0)  # the first prompt's marks went with them
    assert t.match([39_000, 39_001, 39_002, 39_003])["b"] == (0, 0, 4)


def test_a_node_that_left_while_down_is_not_kept_as_down_for_good():
    """Node ids are new on every machine: one that was down when it left must not stay in the tracker."""
    from kvmesh.cluster.index import PrefixIndex
    from kvmesh.cluster.tier_tracker import TierTracker

    tracker = TierTracker(PrefixIndex(max_blocks=100))
    for i in range(100):
        node = f"node-{i}"
        tracker.set_node(node, has_shared_tier=True, host_capacity_blocks=10)
        tracker.drop_node(node, down=True)  # its server stopped answering ...
        assert node in tracker.watched_nodes()
        tracker.forget_node(node)  # ... then the node left the cluster
    assert tracker.watched_nodes() == set()


def test_a_node_that_does_not_answer_is_read_from_no_more_but_its_host_tier_is_kept():
    """A frozen node's LMCache server keeps its contents: while it does not answer nothing is predicted from its
    host tier, and once the same server answers again the kept model is read again, not relearned from zero."""
    idx, t = _setup()
    t.record_prefill("a", [1, 2, 3])
    t.node_unanswering("n1")
    m = t.loadable(idx.match([1, 2, 3]))
    assert m["a"] == (0, 0, 0) and m["a2"] == (0, 0, 0)  # no host tier (nor shared tier) read through n1
    assert m["b"] == (0, 0, 3)  # what n1 wrote to the shared tier stays there
    assert t.stored_prefix("a", "a2", 3) == 0 and t.stored_prefix("a", "b", 3) == 0
    assert "n1" not in t.nodes() and "n1" in t.watched_nodes()
    t.set_node("n1", has_shared_tier=True)  # routing stats cached from before the freeze do not bring it back
    assert t.loadable(idx.match([1, 2, 3]))["a2"] == (0, 0, 0)
    t.node_serving("n1", intact=True)
    m = t.loadable(idx.match([1, 2, 3]))
    assert m["a"] == (0, 3, 3) and m["a2"] == (0, 3, 3)
    assert t.nodes()["n1"] == {"host_blocks": 3, "shared": True}
    assert t.counters["nodes_unanswering"] == 1 and t.counters["nodes_restored"] == 1
    assert t.counters["nodes_dropped"] == 0 and t.stats["tier_nodes_unanswering_now"] == 0


def test_a_node_that_does_not_answer_writes_no_shared_entries_but_its_model_keeps_in_step():
    idx, t = _setup(host_cap=4)
    t.record_prefill("a", [1, 2, 3, 4])
    t.node_unanswering("n1")
    assert t.stats["tier_nodes_unanswering_now"] == 1
    assert t.record_prefill("a", [5, 6]) == 2  # a prefill that did finish there: 3 and 4 leave the host tier
    assert idx.match([5, 6])["b"] == (0, 0, 0)  # no shared-tier writer while it does not answer
    assert t.loadable(idx.match([5, 6]))["a2"] == (0, 0, 0)
    t.node_serving("n1", intact=True)
    assert t.loadable(idx.match([5, 6]))["a2"] == (0, 2, 2)
    assert t.loadable(idx.match([1, 2, 3, 4]))["a2"] == (0, 2, 4)  # 1, 2 in its host tier, all in the shared
    t.apply_events("a", [BlockStored([77], medium="CPU")])  # LMCache chunk hashes, then as now
    t.node_unanswering("n1")
    t.apply_events("a", [BlockStored([78], medium="CPU")])
    assert t.stats["tier_lmcache_events_dropped"] == 2 and idx.match([78])["a"] == (0, 0, 0)


def test_a_node_that_answers_with_another_server_or_not_serving_or_leaves_loses_its_kept_host_tier():
    for end in ("replaced", "down", "left"):
        idx, t = _setup()
        t.record_prefill("a", [1, 2, 3])
        t.node_unanswering("n1")
        if end == "replaced":  # a grown restarts counter, a new actor: another server, empty
            t.node_serving("n1", intact=False)
        elif end == "down":
            t.drop_node("n1", down=True)
        else:  # its engines left while it did not answer: the router drops it, then forgets it
            t.drop_node("n1")
            t.forget_node("n1")
        assert "n1" not in t.nodes(), end
        assert idx.match([1, 2, 3])["a2"] == (0, 0, 3), end  # no host marks left in the index
        assert t.stats["tier_nodes_unanswering_now"] == 0 and t.counters["nodes_restored"] == 0, end
        t.node_serving("n1", intact=True)  # nothing kept: declared anew, cold, by its engines' stats
        t.set_node("n1", has_shared_tier=True)
        assert t.nodes()["n1"]["host_blocks"] == 0, end
    t.drop_node("n1")
    t.forget_node("n1")
    t.forget_node("n2")
    assert t.watched_nodes() == set()


def test_a_restart_seen_while_a_node_does_not_answer_empties_its_kept_host_tier():
    idx, t = _setup()
    t.record_prefill("a", [1, 2, 3])
    t.node_unanswering("n1")
    t.node_restarted("n1")
    assert idx.match([1, 2, 3])["a2"] == (0, 0, 3) and t.counters["host_dropped_on_restart"] == 3


def test_a_node_never_declared_that_does_not_answer_is_held_down_until_it_serves():
    idx, t = _setup()
    idx.add_replica("c", "n3")
    t.node_unanswering("n3")
    t.set_node("n3", has_shared_tier=True)  # its engines' stats: not while its server does not answer
    assert "n3" not in t.nodes() and t.record_prefill("c", [1]) == 0
    t.node_serving("n3", intact=True)
    t.set_node("n3", has_shared_tier=True)
    assert t.record_prefill("c", [1]) == 1


def test_with_every_lmcache_node_down_no_replica_is_credited_a_tier():
    """Down nodes are all there is (their servers died, their engines serve on): the shared blocks the index
    still holds cannot be loaded, so no replica is credited them (before: the raw match, shared included)."""
    idx, t = _setup()
    t.record_prefill("a", [1, 2, 3])
    t.drop_node("n1", down=True)
    assert t.loadable(idx.match([1, 2, 3]))["b"] == (0, 0, 3)  # n2 still reads the shared tier
    t.drop_node("n2", down=True)
    assert not t.any_node()
    assert t.loadable(idx.match([1, 2, 3])) == {"a": (0, 0, 0), "a2": (0, 0, 0), "b": (0, 0, 0)}


def test_a_replica_forgotten_since_its_match_was_taken_reads_no_tier_and_raises_nothing():
    """A match taken at ranking can name a replica that died or left before Serve placed the request; what
    the router reads of it then (miss attribution at placement) must not raise in Serve's callback."""
    idx, t = _setup()
    t.record_prefill("a", [1, 2, 3])
    held = idx.match([1, 2, 3])
    idx.remove_replica("b")
    m = t.loadable(held)
    assert m["b"] == (held["b"][0],) * 3  # nothing beyond its own hbm, as on a node without a server
    assert m["a2"] == (0, 3, 3)  # the others as before
    assert t.loadable(held, whole_chunks=False)["b"] == (held["b"][0],) * 3

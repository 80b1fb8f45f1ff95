"""The server side of miss attribution: what the router knew at placement + what the engine delivered."""

from types import SimpleNamespace

from kvmesh.deployments.miss_attribution import MissAttribution, placement_reason
from kvmesh.kvstore.hashing import block_hashes

B = 32


def _place(attr, rid, tenant_salt, ids, replica, matches, first=None, views=None, tenant=None):
    hashes = block_hashes(ids, B, cache_salt=tenant_salt)
    attr.placed(rid, replica, first or replica, matches, hashes, B, views, tenant=tenant)


def test_cold_then_misrouted_then_evicted_then_isolated_and_the_sums_are_exact():
    attr = MissAttribution()
    ids = list(range(10, 110))  # 100 tokens: 3 full blocks can hit, 4 tokens never
    _place(attr, "q1", "salt-a", ids, "r1", {"r1": (0, 0, 0), "r2": (0, 0, 0)})
    assert attr.delivered("q1", "a", ids, 0) == {"cold": 96, "partial_block": 4}
    # the same prompt went to r2 while r1 held all 3 blocks: misrouted (the router knew)
    _place(attr, "q2", "salt-a", ids, "r2", {"r1": (3, 3, 3), "r2": (0, 0, 0)})
    assert attr.delivered("q2", "a", ids, 0) == {"misrouted": 96, "partial_block": 4}
    # nobody holds it any more, but it was computed: evicted
    _place(attr, "q3", "salt-a", ids, "r1", {"r1": (0, 0, 0), "r2": (0, 0, 0)})
    assert attr.delivered("q3", "a", ids, 32) == {"evicted": 64, "partial_block": 4}
    # another tenant, same tokens, another salt: isolated
    _place(attr, "q4", "salt-b", ids, "r1", {"r1": (0, 0, 0), "r2": (0, 0, 0)})
    assert attr.delivered("q4", "b", ids, 0) == {"isolated": 96, "partial_block": 4}
    rec = attr.explain("q2")
    assert rec["elsewhere_blocks"] == 3 and rec["replica"] == "r2" and "hashes" not in rec
    assert rec["miss_tokens"] == {"misrouted": 96, "partial_block": 4}
    text = attr.prometheus_text()
    assert 'kvmesh_miss_tokens_total{reason="isolated",tenant="b"} 96' in text
    assert 'kvmesh_miss_tokens_total{reason="partial_block",tenant="a"} 12' in text
    assert attr.explain("nope") is None and attr.delivered("nope", "a", ids, 0) is None


def test_the_router_reason_names_load_the_guard_or_serve():
    busy = SimpleNamespace(queued=3, running=1, pending_prefill_tokens=0)
    idle = SimpleNamespace(queued=0, running=0, pending_prefill_tokens=0)
    assert placement_reason("r2", "r1", "r1", {}) == "serve_fallback"
    assert placement_reason("r2", "r2", "r1", {"r1": busy, "r2": idle}) == "load"
    assert placement_reason("r2", "r2", "r1", {"r1": idle, "r2": busy}) == "balance_guard"
    assert placement_reason("r1", "r1", "r1", {}) == ""


def test_records_are_bounded():
    attr = MissAttribution(max_requests=3)
    for i in range(5):
        _place(attr, f"q{i}", "s", list(range(40)), "r1", {"r1": (0, 0, 0)})
    assert attr.explain("q0") is None and attr.explain("q4") is not None


def test_two_requests_sent_together_on_a_new_prefix_are_both_cold_whichever_finishes_first():
    """Both placed before either computed the prefix: the one whose first token comes second found it
    computed at delivery, but at placement it was not, so it is cold, not evicted."""
    attr = MissAttribution()
    ids = list(range(10, 110))
    empty = {"r1": (0, 0, 0), "r2": (0, 0, 0)}
    _place(attr, "q1", "salt-a", ids, "r1", empty, tenant="a")
    _place(attr, "q2", "salt-a", ids, "r2", empty, tenant="a")
    assert attr.delivered("q1", "a", ids, 0) == {"cold": 96, "partial_block": 4}
    assert attr.delivered("q2", "a", ids, 0) == {"cold": 96, "partial_block": 4}
    assert attr.explain("q2")["seen_blocks"] == 0
    # placed after q1 and q2 were computed, with nothing held anywhere: evicted
    _place(attr, "q3", "salt-a", ids, "r1", empty, tenant="a")
    assert attr.delivered("q3", "a", ids, 0) == {"evicted": 96, "partial_block": 4}


def test_a_prompt_counts_as_computed_from_its_first_token_not_from_the_end_of_its_stream():
    attr = MissAttribution()
    ids = list(range(10, 110))
    empty = {"r1": (0, 0, 0), "r2": (0, 0, 0)}
    _place(attr, "q1", "salt-a", ids, "r1", empty, tenant="a")
    attr.started("q1", "a")  # first token back; q1 is still streaming
    _place(attr, "q2", "salt-a", ids, "r2", empty, tenant="a")  # placed while nothing held it: evicted
    assert attr.delivered("q2", "a", ids, 0) == {"evicted": 96, "partial_block": 4}
    assert attr.delivered("q1", "a", ids, 0) == {"cold": 96, "partial_block": 4}  # its own prompt stays cold
    attr.started("nope", "a")  # no record: nothing to do


def test_a_tenant_id_with_any_character_round_trips_through_the_metrics_text():
    """Label values escape backslash, quote and newline (the text format's three): a raw newline in a tenant
    id breaks the whole page for the parser."""
    from prometheus_client.parser import text_string_to_metric_families

    attr = MissAttribution()
    for tenant in ("a\nb", 'we"ird\\ten'):
        attr.counters[("cold", tenant)] = 3
    samples = [s for f in text_string_to_metric_families(attr.prometheus_text()) for s in f.samples]
    assert {s.labels["tenant"] for s in samples} == {"a\nb", 'we"ird\\ten'}

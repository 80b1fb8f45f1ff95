"""Merging every ingress replica's /metrics page: each sample labelled with its replica (also when only
one answered), each family once and together (the text format's rule), the fleet-wide families once."""

from __future__ import annotations

from kvmesh.deployments.fleet_metrics import labelled, merge

PAGE_A = """# HELP kvmesh_requests_total requests served
# TYPE kvmesh_requests_total counter
kvmesh_requests_total{tenant="t1"} 3
kvmesh_requests_total{tenant="t2"} 1
# HELP kvmesh_ttft_seconds time to first token
# TYPE kvmesh_ttft_seconds histogram
kvmesh_ttft_seconds_bucket{le="0.1"} 2
kvmesh_ttft_seconds_bucket{le="+Inf"} 4
kvmesh_ttft_seconds_sum 0.5
kvmesh_ttft_seconds_count 4
"""

PAGE_B = """# HELP kvmesh_requests_total requests served
# TYPE kvmesh_requests_total counter
kvmesh_requests_total{tenant="t1"} 7
# HELP kvmesh_migrations_total migrations
# TYPE kvmesh_migrations_total counter
kvmesh_migrations_total 2
# HELP kvmesh_ttft_seconds time to first token
# TYPE kvmesh_ttft_seconds histogram
kvmesh_ttft_seconds_bucket{le="0.1"} 1
kvmesh_ttft_seconds_bucket{le="+Inf"} 1
kvmesh_ttft_seconds_sum 0.05
kvmesh_ttft_seconds_count 1
"""


def test_a_label_is_added_to_samples_with_and_without_labels():
    assert labelled('m{a="1"} 3', "ingress", "x") == 'm{ingress="x",a="1"} 3'
    assert labelled("m 3", "ingress", "x") == 'm{ingress="x"} 3'
    assert labelled("# TYPE m counter", "ingress", "x") == "# TYPE m counter"


def test_a_page_alone_is_labelled_as_it_is_beside_the_others():
    """A peer that missed one scrape must not turn `{ingress="a"}` into `{}` and back: series churn, and
    every counter's increase lost at each switch."""
    alone = merge({"a": PAGE_A}).splitlines()
    both = merge({"a": PAGE_A, "b": PAGE_B}).splitlines()
    assert 'kvmesh_requests_total{ingress="a",tenant="t1"} 3' in alone
    assert [line for line in alone if not line.startswith("#")] == [line for line in both if 'ingress="a"' in line]


def test_pages_merge_into_one_family_each_with_every_replica_labelled():
    page = merge({"b": PAGE_B, "a": PAGE_A})
    lines = page.splitlines()
    # each family's HELP and TYPE once, its samples right after, from both replicas
    assert lines.count("# TYPE kvmesh_requests_total counter") == 1
    assert lines.count("# TYPE kvmesh_ttft_seconds histogram") == 1
    start = lines.index("# TYPE kvmesh_requests_total counter")
    assert lines[start + 1 : start + 4] == [
        'kvmesh_requests_total{ingress="a",tenant="t1"} 3',
        'kvmesh_requests_total{ingress="a",tenant="t2"} 1',
        'kvmesh_requests_total{ingress="b",tenant="t1"} 7',
    ]
    hist = lines.index("# TYPE kvmesh_ttft_seconds histogram")
    assert lines[hist + 1 :][:8] == [
        'kvmesh_ttft_seconds_bucket{ingress="a",le="0.1"} 2',
        'kvmesh_ttft_seconds_bucket{ingress="a",le="+Inf"} 4',
        'kvmesh_ttft_seconds_sum{ingress="a"} 0.5',
        'kvmesh_ttft_seconds_count{ingress="a"} 4',
        'kvmesh_ttft_seconds_bucket{ingress="b",le="0.1"} 1',
        'kvmesh_ttft_seconds_bucket{ingress="b",le="+Inf"} 1',
        'kvmesh_ttft_seconds_sum{ingress="b"} 0.05',
        'kvmesh_ttft_seconds_count{ingress="b"} 1',
    ]
    # a family only one replica has is kept, labelled
    assert 'kvmesh_migrations_total{ingress="b"} 2' in lines
    # whichever replica answers, the page is the same
    assert merge({"a": PAGE_A, "b": PAGE_B}) == page


def _fleet_page(ingress: int, steps: dict[str, int], host_hits: dict[str, float]) -> str:
    """One ingress replica's page as the ingress writes it: its own counters, the engines' routing stats as
    its router last heard them, and the LMCache nodes' tier figures."""
    from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text
    from kvmesh.deployments.serving_metrics import ServingMetrics
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    serving = ServingMetrics()
    for _ in range(ingress):
        serving.record("engA", 100, 64, 10, 0.2)
    stats = {rid: {"steps": n, "external_hit_tokens": n, "stats_errors": 1} for rid, n in steps.items()}
    router = {"decisions": ingress, "routing_stats": stats}
    status = {
        node: {"health": {"healthy": True, "shared_tier_up": True}, "tiers": {"host_hit_tokens": h}}
        for node, h in host_hits.items()
    }
    return (
        serving.prometheus_text(None, router)
        + failure_metrics_text(FailureCounters(), router)
        + tier_metrics_text(status)
    )


def test_what_every_ingress_replica_reads_alike_is_on_the_merged_page_once():
    """The engines' and the LMCache nodes' own counters: a sum over the merged page is theirs, not a
    multiple of it per ingress replica; what each ingress replica counts itself keeps its label."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = {"nodeA": 400.0, "nodeB": 200.0}
    page = merge(
        {
            "ing-1": _fleet_page(1, {"engA": 100, "engB": 200}, hits),
            "ing-2": _fleet_page(2, {"engA": 100, "engB": 200}, hits),
        }
    )
    fams = {f.name: f for f in text_string_to_metric_families(page)}

    def total(name: str, **labels) -> float:
        return sum(s.value for s in fams[name].samples if labels.items() <= s.labels.items())

    assert total("kvmesh_tier_hit_tokens", tier="host") == 600
    assert total("kvmesh_replica_engine_steps") == 300
    assert total("kvmesh_replica_lmcache_loaded_tokens") == 300
    assert total("kvmesh_replica_stats_errors") == 2
    assert total("kvmesh_tier_server_healthy") == 2
    assert total("kvmesh_requests") == 3  # each ingress replica's own, summed over `ingress`
    assert {s.labels["ingress"] for s in fams["kvmesh_requests"].samples} == {"ing-1", "ing-2"}
    from kvmesh.deployments.fleet_metrics import FLEET_WIDE

    for f in fams.values():
        if f.name + ("_total" if f.type == "counter" else "") in FLEET_WIDE:
            assert all("ingress" not in s.labels for s in f.samples), f.name
    # every fleet-wide family is one the ingress writes (a renamed family would be counted per replica again)
    written = {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE ")}
    assert FLEET_WIDE <= written


def test_a_fleet_wide_series_takes_the_highest_value_any_page_gives():
    """Routers hear the engines' stats at slightly different times: the highest count is the latest (never
    one that went back), and the merged page is the same whichever replica answers. A gauge too: a page that
    could not read a node writes it down, and the first page's could show a node down beside its counters."""
    a = _fleet_page(1, {"engA": 100}, {"nodeA": 10.0})
    b = _fleet_page(1, {"engA": 104}, {"nodeA": 10.0}).replace(
        'kvmesh_tier_server_healthy{node="nodeA"} 1', 'kvmesh_tier_server_healthy{node="nodeA"} 0'
    )
    page = merge({"a": a, "b": b})
    assert 'kvmesh_replica_engine_steps_total{replica="engA"} 104' in page.splitlines()
    assert 'kvmesh_replica_engine_steps_total{replica="engA"} 100' not in page.splitlines()
    assert [line for line in page.splitlines() if line.startswith("kvmesh_tier_server_healthy")] == [
        'kvmesh_tier_server_healthy{node="nodeA"} 1'
    ]
    assert merge({"b": b, "a": a}) == page
    first_down = merge({"a": b, "b": a})  # the page that could not read the node sorts first
    assert [line for line in first_down.splitlines() if line.startswith("kvmesh_tier_server_healthy")] == [
        'kvmesh_tier_server_healthy{node="nodeA"} 1'
    ]


def _whole_page(n: int = 0) -> str:
    """Every part of an ingress replica's GET /metrics, as `Ingress.metrics_page` puts them together."""
    from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text
    from kvmesh.deployments.miss_attribution import MissAttribution
    from kvmesh.deployments.prediction import PredictionLedger
    from kvmesh.deployments.serving_metrics import ServingMetrics
    from kvmesh.deployments.tenant_metrics import TenantMetrics
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    serving, tenants, failures, misses, ledger = (
        ServingMetrics(),
        TenantMetrics(),
        FailureCounters(),
        MissAttribution(),
        PredictionLedger(),
    )
    serving.record("engA", 100, 64, 10, 0.2)
    serving.record("engB", 100, 0, 10, None)
    serving.record_stage("tokenize", 0.001)
    serving.record_error(429)
    tenants.record("acme", 100, 64, 0.2)
    tenants.record_rejection(None, "invalid_api_key")
    failures.migrated("mid_stream")
    misses.counters[("cold", "acme")] = 36
    ledger.predict("q", "engA", 64, 16)
    ledger.deliver("q", 64)
    stats = {"engA": {"steps": 100 + n, "external_hit_tokens": 64, "stats_errors": 0}}
    router = {"index": {"admissions": 5, "blocks": 3, "replicas": 1, "replicas_stale_now": 0}, "decisions": 10}
    router |= {"fallbacks": 1, "decision_s_total": 0.01, "forgotten": 0, "routing_stats": stats}
    status = {
        "nodeA": {"health": {"healthy": True, "shared_tier_up": True}, "tiers": {"host_hit_tokens": 5.0}},
        "nodeB": {"health": {"healthy": False}, "tiers": {}},
    }
    return (
        serving.prometheus_text(ledger.snapshot(), router)
        + tenants.prometheus_text()
        + misses.prometheus_text()
        + failure_metrics_text(failures, router)
        + tier_metrics_text(status)
    )


def test_no_family_on_the_whole_page_mixes_a_total_with_labelled_rows():
    """A family whose samples are a total and its breakdown doubles under a plain sum(): each breakdown is a
    family of its own (kvmesh_replica_*, kvmesh_migrations_by_reason_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(_whole_page()):
        shapes: dict[str, set] = {}
        for sample in family.samples:
            shapes.setdefault(sample.name, set()).add(frozenset(sample.labels) - {"le", "quantile"})
        assert all(len(keys) == 1 for keys in shapes.values()), (family.name, shapes)


def test_the_whole_page_parses_into_one_family_each_of_the_type_it_declares():
    import re

    from prometheus_client.parser import text_string_to_metric_families

    for page in (_whole_page(), merge({"ing-1": _whole_page(0), "ing-2": _whole_page(1)})):
        declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))
        families = list(text_string_to_metric_families(page))
        names = [f.name for f in families]
        assert len(names) == len(set(names)) == len(declared), sorted(n for n in names if names.count(n) > 1)
        for f in families:
            assert f.type != "unknown", f.name
            assert declared.get(f.name + "_total" if f.type == "counter" else f.name) == f.type, f.name


def test_a_replica_missing_a_scrape_lends_its_last_pages_fleet_wide_families_only():
    """ing-2 had heard the engines' newest count; its page missed the next scrape (slow, restarting): the merged
    count went back from 300 to 200, which Prometheus reads as a reset (its increase() counting 200 again). Its
    last page counts for the fleet-wide families, for PAGE_KEEP_S; its own series stay a gap (an older value of
    theirs would step back); a replica gone for good drops out."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.deployments.fleet_metrics import PageCache

    def fams(page: str) -> dict:
        return {f.name: f for f in text_string_to_metric_families(page)}

    def steps(page: str) -> float:
        return sum(s.value for s in fams(page)["kvmesh_replica_engine_steps"].samples)

    cache = PageCache(keep_s=60)
    first = {"ing-1": _fleet_page(1, {"engA": 200}, {}), "ing-2": _fleet_page(1, {"engA": 300}, {})}
    assert steps(merge(cache.pages(first, now=0.0))) == 300
    assert steps(merge({"ing-1": _fleet_page(1, {"engA": 200}, {})})) == 200  # without the cache: back
    later = merge(cache.pages({"ing-1": _fleet_page(1, {"engA": 250}, {})}, now=10.0))
    assert steps(later) == 300
    assert {s.labels["ingress"] for s in fams(later)["kvmesh_requests"].samples} == {"ing-1"}  # ing-2's: a gap
    gone = merge(cache.pages({"ing-1": _fleet_page(1, {"engA": 350}, {})}, now=61.0))
    assert steps(gone) == 350


def test_a_lent_page_gives_counters_only_so_a_stale_up_never_masks_a_fresh_down():
    """A replica missing a scrape lent its whole fleet-wide part, gauges too, and each series took the highest
    value: the node and shared tier every fresh page reports down read up for as long as the lent page counted
    (PAGE_KEEP_S). Its counters still count (a count that only grows); its gauges do not."""
    from kvmesh.deployments.fleet_metrics import PageCache
    from kvmesh.kvstore.tier_metrics import tier_metrics_text

    up = {"n1": {"health": {"healthy": True, "shared_tier_up": True}, "tiers": {"host_hit_tokens": 100.0}}}
    down = {"n1": {"health": {"healthy": False, "shared_tier_up": False}, "tiers": {}}}
    cache = PageCache(keep_s=60)
    cache.pages({"a": tier_metrics_text(up), "b": tier_metrics_text(up)}, now=0.0)
    lines = merge(cache.pages({"a": tier_metrics_text(down)}, now=30.0)).splitlines()
    assert 'kvmesh_tier_server_healthy{node="n1"} 0' in lines
    assert 'kvmesh_tier_shared_up{node="n1"} 0' in lines
    assert [line for line in lines if line.startswith(("kvmesh_tier_server_healthy", "kvmesh_tier_shared_up"))] == [
        'kvmesh_tier_server_healthy{node="n1"} 0',
        'kvmesh_tier_shared_up{node="n1"} 0',
    ]
    # b's last counters still count: the node's hit tokens do not step back while a cannot read it
    assert 'kvmesh_tier_hit_tokens_total{node="n1",tier="host"} 100.0' in lines
    # a fresh page of b decides again, beside a's
    fresh = merge(cache.pages({"a": tier_metrics_text(down), "b": tier_metrics_text(up)}, now=40.0)).splitlines()
    assert 'kvmesh_tier_server_healthy{node="n1"} 1' in fresh

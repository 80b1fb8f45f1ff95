"""Merging every ingress replica's /metrics page: each sample labelled with its replica, each family once
and together (the text format's rule), one replica's page unchanged."""

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


def test_one_replica_keeps_its_page():
    assert merge({"a": PAGE_A}) == PAGE_A


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

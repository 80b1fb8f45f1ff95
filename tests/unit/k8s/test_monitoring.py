"""Offline checks of k8s/monitoring: every metric the Grafana dashboard queries is one kvmesh or vLLM
really exports, and the PodMonitor selects the kvmesh pods on ports they declare.

kvmesh's names come from its own exposition code run on sample data (what GET /metrics prints);
vLLM's from the metrics vLLM's Prometheus logger declares, named as Ray exports them (async engines
publish through Ray: `vllm:x` becomes `ray_vllm_x`, counters gain `_total`, histograms
`_bucket/_sum/_count`, as in Ray's own vLLM dashboards).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from paths import REPO_ROOT
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.deployments.prediction import PredictionLedger
from kvmesh.deployments.serving_metrics import ServingMetrics
from kvmesh.deployments.tenant_metrics import TenantMetrics
from kvmesh.kvstore.tier_metrics import tier_metrics_text

MONITORING = REPO_ROOT / "k8s" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "kvmesh-dashboard.json"
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "topk", "bottomk",
}  # fmt: skip


def kvmesh_metric_names() -> set[str]:
    """Sample names in the text the ingress's GET /metrics assembles."""
    serving = ServingMetrics()
    serving.record("replica-a", 64, 32, 8, 0.05)
    serving.record_error(429)
    ledger = PredictionLedger()
    router = {
        "index": {"stored": 1},
        "decisions": 1,
        "decision_s_total": 0.01,
        "fallbacks": 0,
        "forgotten": 0,
        "routing_stats": {"replica-a": {"steps": 3, "external_hit_tokens": 0}},
    }
    tenants = TenantMetrics()
    tenants.record("t1", 64, 32, 0.05)
    tenants.record_rejection("t1", "rate_limited")
    status = {
        "node-1": {"health": {"healthy": True, "shared_tier_up": True}, "tiers": {"host_hit_tokens": 1}},
    }
    text = serving.prometheus_text(ledger.snapshot(), router) + tenants.prometheus_text() + tier_metrics_text(status)
    try:  # request migrations (engine deaths): exported beside the serving metrics when present
        from kvmesh.deployments.failure_metrics import FailureCounters, failure_metrics_text

        failures = FailureCounters()
        failures.migrated("mid_stream")
        text += failure_metrics_text(failures, router)
    except ImportError:
        pass
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def vllm_metric_names() -> set[str]:
    """vLLM's Prometheus metrics as Ray exports them, read from vLLM's source (no vLLM import)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = (Path(list(spec.submodule_search_locations)[0]) / "v1" / "metrics" / "loggers.py").read_text()
    declared = re.findall(r'_(counter|gauge|histogram)_cls\(\s*name="vllm:([a-z_]+)"', source)
    assert len(declared) > 20, "vLLM's metric declarations changed shape: update this reader"
    names = set()
    for kind, name in declared:
        base = f"ray_vllm_{name}"
        suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}[kind]
        names |= {base + s for s in suffixes}
    return names


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = m.group(0)
        if word in PROMQL_WORDS or expr[m.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def test_the_promql_reader_finds_metric_names():
    expr = 'histogram_quantile(0.9, sum by (tenant, le) (rate(kvmesh_x_bucket{a="b(c)"}[5m]))) / max(vllm_y)'
    assert promql_metric_names(expr) == {"kvmesh_x_bucket", "vllm_y"}


def test_every_dashboard_metric_is_exported_by_kvmesh_or_vllm():
    known = kvmesh_metric_names() | vllm_metric_names()
    unknown = [f"{title}: {name}" for title, expr in dashboard_queries() for name in promql_metric_names(expr)]
    unknown = [u for u in unknown if u.split(": ")[1] not in known]
    assert unknown == []


def test_the_dashboard_covers_hit_rates_tiers_ttft_routing_and_the_alarm():
    used = {name for _, expr in dashboard_queries() for name in promql_metric_names(expr)}
    for name in (
        "kvmesh_cached_prompt_tokens_total",  # token-weighted, the fleet
        "kvmesh_replica_cached_prompt_tokens_total",  # token-weighted, per replica
        "kvmesh_hit_rate_requests",  # request-weighted, the fleet
        "kvmesh_replica_hit_rate_requests",  # request-weighted, per replica
        "kvmesh_tenant_cached_tokens_total",
        "kvmesh_tenant_hit_rate_requests",
        "kvmesh_tier_hit_tokens_total",
        "kvmesh_replica_lmcache_loaded_tokens_total",  # what the tiers served (the lookups over-count)
        "ray_vllm_prefix_cache_hits_total",
        "kvmesh_ttft_seconds_bucket",
        "kvmesh_router_fallbacks_total",
        "kvmesh_predicted_cached_tokens_total",
        "kvmesh_delivered_cached_tokens_total",
        "kvmesh_hash_contract_alarm",
    ):
        assert name in used, name


def test_the_dashboard_never_tells_fleet_totals_from_replica_rows_by_a_label():
    """Per-replica figures are families of their own (kvmesh_replica_*): a query selecting `replica=""` would
    find nothing, and a plain sum over a fleet family is the fleet's figure."""
    for title, expr in dashboard_queries():
        assert not re.search(r'replica\s*!?=\s*""', expr), f"{title}: {expr}"
    text = " ".join(expr for _, expr in dashboard_queries())
    assert "kvmesh_replica_cached_prompt_tokens_total" in text and "kvmesh_replica_prompt_tokens_total" in text


def test_dashboard_panels_are_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in dash["templating"]["list"])
    for p in dash["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_the_pod_monitor_scrapes_ports_the_kvmesh_pods_declare():
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    service = yaml.safe_load((REPO_ROOT / "k8s" / "rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports: set[str] = set()
    for t in templates:
        assert selector.items() <= (t.get("metadata", {}).get("labels") or {}).items()
        ports |= {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    for gen in kustomization["configMapGenerator"]:
        assert all((MONITORING / f).is_file() for f in gen["files"])


def test_the_dashboard_reads_migrations_from_the_total_and_their_reasons_from_their_own_family():
    """kvmesh_migrations_total is the total alone: a `reason=""` selector is a leftover of the days it also held
    the per-reason rows, and a sum by reason of it would find none."""
    text = " ".join(expr for _, expr in dashboard_queries())
    assert "sum(rate(kvmesh_migrations_total[" in text
    assert "sum by (reason) (rate(kvmesh_migrations_by_reason_total[" in text
    for title, expr in dashboard_queries():
        assert not re.search(r'reason\s*!?=\s*""', expr), f"{title}: {expr}"
        assert not ("kvmesh_migrations_total" in expr and "reason" in expr), f"{title}: {expr}"

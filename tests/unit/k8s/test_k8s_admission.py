"""The shipped Kubernetes example's global admission bound against the engines' autoscaling: the requests
the ingress replicas let through are all Serve's autoscaler sees, so a bound below max_replicas x
target_ongoing_requests keeps the engines from ever reaching max_replicas."""

from __future__ import annotations

import yaml
from paths import REPO_ROOT

from kvmesh.deployments.config import app_config, serve_autoscaling
from kvmesh.deployments.deploy_plan import admission_ceiling_problem

K8S = REPO_ROOT / "k8s"


def _shipped() -> tuple[dict, dict]:
    """(the k8s serving config, resolved; the tenants example's `admission` mapping)."""
    cfg = app_config(yaml.safe_load((K8S / "config" / "kvmesh.yaml").read_text()))
    secret = yaml.safe_load((K8S / "tenants-secret.example.yaml").read_text())
    tenants = yaml.safe_load(secret["stringData"]["tenants.yaml"])
    return cfg, tenants.get("admission") or {}


def test_the_shipped_admission_bound_lets_the_engines_scale_to_max_replicas():
    cfg, admission = _shipped()
    auto = serve_autoscaling(cfg["autoscaling"])
    bound = admission.get("max_concurrent")
    if bound is not None:  # no bound: nothing caps what the autoscaler sees
        assert bound * cfg["ingress_replicas"] >= auto.max_replicas * auto.get_target_ongoing_requests()
    assert admission_ceiling_problem(cfg, admission) is None


def test_a_bound_below_what_the_autoscaler_needs_is_named_with_the_replicas_it_allows():
    cfg, _ = _shipped()
    problem = admission_ceiling_problem(cfg, {"max_concurrent": 64})
    assert problem is not None
    assert "64 x ingress_replicas 2 = 128" in problem and "only 6 engine replicas" in problem
    assert "at least 192" in problem
    assert admission_ceiling_problem(cfg, {"max_concurrent": 192}) is None
    assert admission_ceiling_problem(cfg, {}) is None  # no global bound
    assert admission_ceiling_problem(app_config({}), {"max_concurrent": 1}) is None  # no autoscaling

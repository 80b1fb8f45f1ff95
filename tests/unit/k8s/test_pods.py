"""The KubeRay manifest checked at the level of pods: would every kvmesh deployment find a pod to run on,
and would it find there every file it reads?

A pod offers Ray what KubeRay tells its raylet (rayStartParams, else the container's limits); a
deployment replica asks for what `deploy_plan.actor_resources` says `build_app` asks for; it "can land"
on every pod group whose pod offers that much. On each such pod, every path from
`deploy_plan.files_read` must lie under a volume mount. These checks are `deploy_plan`'s, the ones
`kvmesh k8s render` refuses a config with. The Serve config itself must be what `kvmesh k8s render` makes
from k8s/config/kvmesh.yaml, with no per-deployment overrides (Serve would replace the code's whole
ray_actor_options with them).
"""

from __future__ import annotations

import copy

import pytest
import yaml
from paths import REPO_ROOT

from kvmesh.deployments import deploy_plan
from kvmesh.deployments.app import build_app
from kvmesh.deployments.config import app_config
from kvmesh.deployments.deploy_plan import (
    ENGINE,
    INGRESS,
    engine_capacity,
    kuberay_problems,
    max_engine_replicas,
    render_serve_config,
    replace_block,
)
from kvmesh.kvstore.tiers import normalise_l2

K8S = REPO_ROOT / "k8s"
CONFIG = K8S / "config" / "kvmesh.yaml"
MANIFEST = K8S / "rayservice.yaml"


def _docs(kind: str) -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    return out


@pytest.fixture
def service() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _app(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]


def _groups(service: dict) -> dict[str, dict]:
    return deploy_plan.pod_groups(service)


def landing_groups(service: dict) -> dict[str, list[str]]:
    """deployment -> the pod groups one of its replicas fits on (for the manifest's own Serve config)."""
    return deploy_plan.landing_groups(_app(service)["args"], service)


def missing_files(service: dict) -> list[str]:
    """'deployment on group: what (path)' for every file a deployment would not find where it can land."""
    return deploy_plan.missing_files(_app(service)["args"], service)


def test_serve_config_is_rendered_from_the_kvmesh_config():
    """The manifest's serveConfigV2 is exactly `kvmesh k8s render`'s output (the builder's, not a hand copy),
    and so are its pod templates' node-server digests."""
    from kvmesh.deployments.cli.k8s import NODE_SERVER_ANNOTATION, node_server_digest, rendered_manifest

    manifest = MANIFEST.read_text()
    wanted = replace_block(manifest, "serveConfigV2", render_serve_config(yaml.safe_load(CONFIG.read_text())))
    assert manifest == wanted, "k8s/rayservice.yaml is out of date: run `kvmesh k8s render`"
    assert rendered_manifest(CONFIG, MANIFEST) == (manifest, manifest), "out of date: run `kvmesh k8s render`"
    digest = node_server_digest(yaml.safe_load(CONFIG.read_text()))
    service = yaml.safe_load(manifest)
    for group in _groups(service):
        template = (
            service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
            if group == "head"
            else next(g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == group)[
                "template"
            ]
        )
        assert template["metadata"]["annotations"][NODE_SERVER_ANNOTATION] == digest, group


def test_serve_config_overrides_no_deployment_options(service):
    """A `deployments:` entry would replace the code's ray_actor_options (CPUs, runtime env) wholesale."""
    assert "deployments" not in _app(service)


def test_the_built_app_keeps_the_codes_resources_and_runtime_env(service):
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    args = _app(service)["args"]
    # the way Serve's controller calls the import path's builder with serveConfigV2's args
    ingress = call_user_app_builder_with_args_if_necessary(build_app, args)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert engine.name == ENGINE and ingress.name == INGRESS
    opts = engine.ray_actor_options
    assert (opts["num_gpus"], opts["num_cpus"]) == (1, 8)
    assert opts["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"
    assert ingress.ray_actor_options["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"
    auto = engine._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas) == (2, 16)


def test_every_deployment_fits_some_pod_group(service):
    where = landing_groups(service)
    assert where[INGRESS], "the Ingress fits on no pod"
    assert "head" in where[INGRESS]  # the head serves HTTP; its Ingress must not wait for a GPU pod
    assert where[ENGINE] and "head" not in where[ENGINE]  # engines need a GPU


def test_engine_autoscaling_fits_the_worker_groups(service):
    args = _app(service)["args"]
    assert max_engine_replicas(app_config(args)) <= engine_capacity(args, service) == 16
    assert kuberay_problems(args, service) == []  # what `kvmesh k8s render` checks before it writes


def test_every_file_a_deployment_reads_is_mounted_where_it_can_land(service):
    assert missing_files(service) == []


def test_the_mount_check_catches_a_missing_mount(service):
    broken = copy.deepcopy(service)
    worker = broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["volumeMounts"] = [m for m in worker["volumeMounts"] if m["name"] != "tenants"]
    head = broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["volumeMounts"] = [m for m in head["volumeMounts"] if m["name"] != "models"]
    problems = missing_files(broken)
    assert any(p.startswith("Ingress on gpu-engines: tenants file") for p in problems)
    assert any(p.startswith("Ingress on head: tokenizer") for p in problems)


def test_the_mount_check_catches_a_missing_channel_secret(service):
    """Engines refuse to start without the KV-event channel secret, and a router without it routes on load
    alone: a pod group that lacks it is a manifest that cannot run."""
    broken = copy.deepcopy(service)
    worker = broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["volumeMounts"] = [m for m in worker["volumeMounts"] if m["name"] != "channel"]
    problems = kuberay_problems(_app(broken)["args"], broken)
    assert any(p.startswith("not mounted: EngineReplica on gpu-engines: channel secret") for p in problems)
    assert any(p.startswith("not mounted: Ingress on gpu-engines: channel secret") for p in problems)
    unset = copy.deepcopy(service)
    head = unset["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [e for e in head["env"] if e["name"] != "KVMESH_CHANNEL_SECRET_FILE"]
    assert "Ingress on head: channel secret (None)" in missing_files(unset)


def test_a_fractional_cpu_limit_is_rounded_up_as_kuberay_does(service):
    """KubeRay passes `--num-cpus` as the limit's Quantity.Value(), which rounds up: 7500m is 8 CPUs, so an
    engine asking for 8 fits and the manifest runs."""
    fractional = copy.deepcopy(service)
    group = fractional["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["rayStartParams"].pop("num-cpus", None)
    resources = group["template"]["spec"]["containers"][0]["resources"]
    resources["limits"]["cpu"] = resources["requests"]["cpu"] = "7500m"
    assert deploy_plan.ray_resources(_groups(fractional)["gpu-engines"])["CPU"] == 8
    assert kuberay_problems(_app(fractional)["args"], fractional) == []


def test_the_fit_check_catches_a_head_without_cpus(service):
    broken = copy.deepcopy(service)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = "0"
    assert "head" not in landing_groups(broken)[INGRESS]


def test_the_shared_tier_is_the_valkey_service_over_resp(service):
    """The engines' L2 is the Valkey Service, spoken to through LMCache's RESP adapter: the same
    `redis://` spelling the live tier tests run against a real redis-server
    (tests/integration/test_tiers_lmcache.py uses RedisServer.url)."""
    l2 = normalise_l2(_app(service)["args"]["engine"]["lmcache"]["l2"])
    valkey = [s for s in _docs("Service") if s["metadata"]["name"] == l2["host"]]
    assert valkey, f"no Service named {l2['host']} in k8s/"
    assert l2["type"] == "resp" == normalise_l2("redis://127.0.0.1:6379")["type"]
    assert l2["port"] in [p["port"] for p in valkey[0]["spec"]["ports"]]


def test_every_pod_sets_serves_request_path_like_a_local_run(service):
    """Serve reads its request-path settings in each replica's process, from the node's environment: a pod
    without them would run the ingress and engine replicas on the slower default path (thread hand-offs,
    Ray actor calls) that local runs and the benchmarks no longer measure."""
    from kvmesh.deployments.config import SERVE_PATH_ENV

    for name, group in _groups(service).items():
        for container in group["pod"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env") or []}
            missing = {k: v for k, v in SERVE_PATH_ENV.items() if env.get(k) != v}
            assert not missing, f"{name}/{container['name']} lacks {missing}"

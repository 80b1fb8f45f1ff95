"""Offline validation of k8s/: the RayService against the real KubeRay v1.7.0 CRD schema (strict: an
unknown key anywhere is an error, as `kubectl --validate=strict` would say), and its serveConfigV2
against Ray Serve's own ServeDeploySchema plus a strict key check (Serve silently drops unknown
autoscaling keys, so a typo would otherwise pass)."""

from __future__ import annotations

import copy
import json
import typing

import jsonschema
import pydantic
import pytest
import yaml
from paths import REPO_ROOT

ROOT = REPO_ROOT
K8S = ROOT / "k8s"
SCHEMA = ROOT / "tests" / "fixtures" / "kuberay" / "rayservice-v1.openapi.json"


def _strict(schema: dict) -> dict:
    """Forbid keys a CRD schema does not declare (the API server would prune or reject them)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def _docs(kind: str) -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == kind]
    return out


def _models(annotation) -> list[type[pydantic.BaseModel]]:
    """Pydantic models an annotation may hold (through Optional/Union/List)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def unknown_keys(value, model: type[pydantic.BaseModel], where: str = "") -> list[str]:
    """Keys in `value` that `model` (recursively) does not declare."""
    problems = []
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    for key, sub in value.items():
        if key not in names:
            problems.append(f"{where}{key}")
            continue
        for inner in _models(fields[key].annotation):
            items = sub if isinstance(sub, list) else [sub]
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    problems += unknown_keys(item, inner, f"{where}{key}[{i}].")
            break
    return problems


def check_serve_config(text: str) -> list[str]:
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, ServeDeploySchema

    config = yaml.safe_load(text)
    ServeDeploySchema.model_validate(config)  # raises on wrong types / values
    problems = unknown_keys(config, ServeDeploySchema)
    for app in config.get("applications", []):
        for dep in app.get("deployments", []):
            DeploymentSchema.model_validate(dep)
            problems += unknown_keys(
                dep.get("autoscaling_config") or {}, AutoscalingConfig, f"{dep['name']}.autoscaling_config."
            )
    return problems


@pytest.fixture(scope="module")
def validator():
    schema = _strict(json.loads(SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


def test_rayservice_matches_kuberay_crd(validator):
    services = _docs("RayService")
    assert services, "k8s/ has no RayService"
    for svc in services:
        errors = sorted(validator.iter_errors(svc), key=str)
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_strict_crd_validation_rejects_a_typo(validator):
    svc = copy.deepcopy(_docs("RayService")[0])
    svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3  # typo of maxReplicas
    assert any("maxReplica" in e.message for e in validator.iter_errors(svc))


def test_serve_config_is_valid_and_has_no_unknown_keys():
    for svc in _docs("RayService"):
        assert check_serve_config(svc["spec"]["serveConfigV2"]) == []


def test_serve_config_check_catches_autoscaling_typo():
    """Autoscaling lives in the kvmesh config (Serve drops unknown autoscaling keys, kvmesh does not)."""
    from kvmesh.deployments.config import ConfigError, app_config

    text = _docs("RayService")[0]["spec"]["serveConfigV2"].replace("target_ongoing_requests", "target_ongoing_request")
    with pytest.raises(ConfigError, match="target_ongoing_request"):
        app_config(yaml.safe_load(text)["applications"][0]["args"])


def test_gpu_workers_and_engines_ask_for_one_gpu_each():
    from kvmesh.deployments.config import app_config
    from kvmesh.deployments.deploy_plan import ENGINE, actor_resources

    svc = _docs("RayService")[0]
    group = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert actor_resources(args)[ENGINE]["GPU"] == 1
    assert app_config(args)["autoscaling"]["max_replicas"] <= group["maxReplicas"]


def test_serve_args_are_a_valid_kvmesh_config():
    """The RayService's app args go through the same validation as `kvmesh serve --config`."""
    from kvmesh.deployments.app import build_app
    from kvmesh.deployments.config import app_config

    config = yaml.safe_load(_docs("RayService")[0]["spec"]["serveConfigV2"])
    app = config["applications"][0]
    module, func = app["import_path"].split(":")
    assert (module, func) == (build_app.__module__, build_app.__name__)
    cfg = app_config(app["args"])
    assert cfg["engine"]["num_gpus"] == 1 and cfg["engine"]["block_size"] == 16


def test_every_pod_reads_the_salt_secret_from_a_file():
    """Every Ray pod (ingress replicas may land on workers) must derive the same salts, and the secret
    must not travel as an env var value (Ray logs runtime_env env vars)."""
    svc = _docs("RayService")[0]["spec"]["rayClusterConfig"]
    pods = [svc["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in svc["workerGroupSpecs"]]
    for pod in pods:
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert "KVMESH_SALT_SECRET" not in env
        path = env["KVMESH_SALT_SECRET_FILE"]["value"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert path.startswith(mounts["salt"] + "/")
        assert vols["salt"]["secret"]["secretName"] == "kvmesh-salt-secret"


# RayService fields that KubeRay v1.7.0's CRD still accepts but its operator no longer reads
# (ray-operator/apis/ray/v1/rayservice_types.go: "Deprecated: This field is not used anymore").
UNUSED_RAYSERVICE_FIELDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
INITIALIZING_TIMEOUT = "ray.io/initializing-timeout"


def test_the_rayservice_sets_no_field_kuberay_ignores():
    """A field the operator ignores promises a reader a timeout that never applies."""
    for svc in _docs("RayService"):
        assert not UNUSED_RAYSERVICE_FIELDS & set(svc["spec"])


def test_a_slow_gpu_start_is_not_cut_short():
    """KubeRay v1.7.0 bounds a RayService's initialization only through the ray.io/initializing-timeout
    annotation, and a start that exceeds it fails for good (the RayService must be recreated). Without it
    KubeRay waits as long as GPU pods and model loads take."""
    for svc in _docs("RayService"):
        assert INITIALIZING_TIMEOUT not in (svc["metadata"].get("annotations") or {})

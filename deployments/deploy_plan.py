"""What the kvmesh Serve app asks of a cluster, computed from the serving config alone.

Why one module: `build_app` (every `kvmesh serve`, test and demo app), the KubeRay manifest's
`serveConfigV2` (`kvmesh k8s render`) and the manifest tests read the same answers, so a deployment's
resources, the files it reads and the Serve config that deploys it cannot drift apart. The Serve config
carries the kvmesh config as the app builder's args and no per-deployment overrides: Serve replaces a
deployment's whole `ray_actor_options` with the config file's, which would drop the CPUs and the
runtime env the code sets. Nothing here talks to Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.deployments.config import app_config

IMPORT_PATH = "kvmesh.deployments.app:build_app"
ENGINE = "EngineReplica"
INGRESS = "Ingress"
INGRESS_NUM_CPUS = 0.1  # tokenizing, admission and routing: light next to an engine
SALT_FILE_ENV = "KVMESH_SALT_SECRET_FILE"


def engine_cpu_threads(eng: Mapping[str, Any]) -> int | None:
    """OpenMP threads for a CPU engine's model compute: `cpu_threads`, else its CPU share rounded down (at
    least 1); None for a GPU engine. Why: Ray sets OMP_NUM_THREADS only for whole CPUs, so an engine with
    half a CPU ran one OpenMP thread per core of the node. Three such engines on 2 cores, eval draw 2005
    replayed three times on one app: 33-34 ms of engine CPU per request with two threads each, 24-29 with
    one; each replay took 5.1-5.5 s against 4.1-4.7 s."""
    if eng["cpu_threads"] is not None:
        return int(eng["cpu_threads"])
    if eng["num_gpus"]:
        return None
    return max(1, int(eng["num_cpus"]))


def engine_options(cfg: Mapping[str, Any], env_vars: Mapping[str, str]) -> dict[str, Any]:
    """Serve options of the engine deployment (everything but the request router, which needs Ray)."""
    eng = cfg["engine"]
    env = dict(env_vars)
    threads = engine_cpu_threads(eng)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    opts: dict[str, Any] = {
        "max_ongoing_requests": cfg["max_ongoing_requests"],
        "ray_actor_options": {
            "num_cpus": eng["num_cpus"],
            "num_gpus": eng["num_gpus"],
            "runtime_env": {"env_vars": env},
        },
        "health_check_period_s": eng["health_check_period_s"],
        "graceful_shutdown_timeout_s": 5,
    }
    if eng.get("resources"):
        opts["ray_actor_options"]["resources"] = dict(eng["resources"])
    if cfg.get("autoscaling"):
        opts["num_replicas"] = "auto"
        opts["autoscaling_config"] = dict(cfg["autoscaling"])
    else:
        opts["num_replicas"] = cfg["replicas"]
    return opts


def max_engine_replicas(cfg: Mapping[str, Any]) -> int:
    auto = cfg.get("autoscaling") or {}
    return int(auto.get("max_replicas") or cfg["replicas"])


def ingress_options(cfg: Mapping[str, Any], env_vars: Mapping[str, str]) -> dict[str, Any]:
    """Serve options of the ingress deployment: it must admit every engine's share of requests."""
    return {
        "num_replicas": cfg["ingress_replicas"],
        "max_ongoing_requests": max(256, cfg["max_ongoing_requests"] * max_engine_replicas(cfg)),
        "ray_actor_options": {"num_cpus": INGRESS_NUM_CPUS, "runtime_env": {"env_vars": dict(env_vars)}},
    }


def actor_resources(config: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """deployment -> the Ray resources one replica of it needs (what a node must have free to host it)."""
    cfg = app_config(config)
    eng = cfg["engine"]
    engine = {"CPU": float(eng["num_cpus"])}
    if eng["num_gpus"]:
        engine["GPU"] = float(eng["num_gpus"])
    engine.update({k: float(v) for k, v in (eng.get("resources") or {}).items()})
    return {ENGINE: engine, INGRESS: {"CPU": INGRESS_NUM_CPUS}}


def files_read(config: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, dict[str, str | None]]:
    """deployment -> {what: path} for every file a replica reads at start-up, on the node it lands on.

    `env` is that node's environment (a pod's env): the salt secret's path comes from it. A value of
    None means the file's location is unknown there (the variable is unset), which no mount can fix.
    The embedded tiny model is built locally and needs no mount.
    """
    cfg = app_config(config)
    model = cfg["engine"]["model"]
    model_dir = None if model == "tiny" else model
    engine: dict[str, str | None] = {}
    ingress: dict[str, str | None] = {"salt secret": env.get(SALT_FILE_ENV)}
    if model_dir:
        engine["model"] = model_dir
        ingress["tokenizer"] = model_dir
    if cfg["tenants_file"]:
        ingress["tenants file"] = cfg["tenants_file"]
    return {ENGINE: engine, INGRESS: ingress}


def serve_deploy_config(
    config: Mapping[str, Any], *, http_host: str = "0.0.0.0", http_port: int = 8000, proxy_location: str = "HeadOnly"
) -> dict[str, Any]:
    """The Serve deploy config (`serve deploy` / KubeRay `serveConfigV2`) for a kvmesh config.

    The args are the config as given (validated here, defaults left to the builder), so a reader sees
    exactly what the operator set; the builder fills the rest as it does for `kvmesh serve --config`.
    """
    cfg = app_config(config)  # raises ConfigError on a bad config, before anything is written
    return {
        "proxy_location": proxy_location,
        "http_options": {"host": http_host, "port": http_port},
        "applications": [
            {
                "name": cfg["name"],
                "route_prefix": cfg["route_prefix"],
                "import_path": IMPORT_PATH,
                "args": dict(config),
            }
        ],
    }


def render_serve_config(config: Mapping[str, Any], **kwargs: Any) -> str:
    """`serve_deploy_config` as the YAML text that goes into the manifest."""
    import yaml

    class _Indented(yaml.SafeDumper):  # list items indented under their key, as hand-written manifests are
        def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
            super().increase_indent(flow, False)

    return yaml.dump(serve_deploy_config(config, **kwargs), Dumper=_Indented, sort_keys=False, default_flow_style=False)


def replace_block(manifest: str, key: str, text: str) -> str:
    """`manifest` with the literal block `key: |` replaced by `text` (indented as the old block was).

    Textual, so the manifest's comments and layout survive; raises ValueError when the key is absent.
    """
    lines = manifest.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == f"{key}: |":
            indent = len(line) - len(line.lstrip()) + 2
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) >= indent):
                end += 1
            while end > i + 1 and not lines[end - 1].strip():  # keep blank lines that follow the block
                end -= 1
            body = "".join(" " * indent + row + "\n" if row else "\n" for row in text.rstrip("\n").split("\n"))
            return "".join(lines[: i + 1]) + body + "".join(lines[end:])
    raise ValueError(f"no literal block '{key}: |' in the manifest")

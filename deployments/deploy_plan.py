"""What the kvmesh Serve app asks of a cluster, computed from the serving config alone.

Why one module: `build_app` (every `kvmesh serve`, test and demo app), the KubeRay manifest's
`serveConfigV2` (`kvmesh k8s render`) and the manifest tests read the same answers, so a deployment's
resources, the files it reads and the Serve config that deploys it cannot drift apart. The Serve config
carries the kvmesh config as the app builder's args and no per-deployment overrides: Serve replaces a
deployment's whole `ray_actor_options` with the config file's, which would drop the CPUs and the
runtime env the code sets. `kuberay_problems` checks a config against a RayService manifest's pods (what
`kvmesh k8s render` refuses, and what the manifest tests assert). Nothing here talks to Ray.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kvmesh.deployments.config import app_config, serve_autoscaling

IMPORT_PATH = "kvmesh.deployments.app:build_app"
ENGINE = "EngineReplica"
INGRESS = "Ingress"
INGRESS_NUM_CPUS = 0.1  # tokenizing, admission and routing: light next to an engine
SALT_FILE_ENV = "KVMESH_SALT_SECRET_FILE"
CHANNEL_FILE_ENV = "KVMESH_CHANNEL_SECRET_FILE"  # the KV-event streams' CURVE keys (cluster/secure_channel.py)


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


# How often a stopping replica looks whether its requests in flight have finished (Serve's
# graceful_shutdown_wait_loop_s). Serve's default, 2 s, is slept before the first look: every stop, scale-down and
# replacement of an idle replica took at least that long. The look only reads a counter.
SHUTDOWN_POLL_S = 0.5


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
        "graceful_shutdown_timeout_s": eng["drain_timeout_s"],
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
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
    """Engine replicas Serve may run at most: `replicas`, or with autoscaling the `max_replicas` Serve
    resolves (`config.serve_autoscaling`: 100 where the mapping names none), which the CPU check, the
    start-up line and the ingress's admission count."""
    auto = cfg.get("autoscaling")
    if not auto:
        return int(cfg["replicas"])
    return int(serve_autoscaling(auto).max_replicas)


def admission_ceiling_problem(cfg: Mapping[str, Any], admission: Mapping[str, Any] | None) -> str | None:
    """Why the tenants file's global `admission.max_concurrent` (per ingress replica) keeps Serve's autoscaler
    from reaching the engines' max_replicas, or None. Serve sizes the engines by the requests in flight over
    `target_ongoing_requests`, and no more than max_concurrent x ingress_replicas are ever in flight: with 64
    x 2 against 16 x 24, the engines stopped at ceil(128 / 24) = 6 of 16. The tenants file is a Secret that
    `kvmesh k8s render` does not see, so the ingress checks this at its start."""
    bound = (admission or {}).get("max_concurrent")
    auto = cfg.get("autoscaling")
    if bound is None or not auto:
        return None
    scaling = serve_autoscaling(auto)
    target = scaling.get_target_ongoing_requests()
    need = scaling.max_replicas * target
    have = int(bound) * int(cfg["ingress_replicas"])
    if have >= need:
        return None
    return (
        f"admission.max_concurrent {bound} x ingress_replicas {cfg['ingress_replicas']} = {have} requests in flight "
        f"at most, below autoscaling max_replicas {scaling.max_replicas} x target_ongoing_requests {target:g} = "
        f"{need:g}: Serve's autoscaler can reach only {math.ceil(have / target)} engine replicas; raise "
        f"admission.max_concurrent to at least {math.ceil(need / int(cfg['ingress_replicas']))} or remove it"
    )


def ingress_options(cfg: Mapping[str, Any], env_vars: Mapping[str, str]) -> dict[str, Any]:
    """Serve options of the ingress deployment: it must admit every engine's share of requests."""
    return {
        "num_replicas": cfg["ingress_replicas"],
        "max_ongoing_requests": max(256, cfg["max_ongoing_requests"] * max_engine_replicas(cfg)),
        "ray_actor_options": {"num_cpus": INGRESS_NUM_CPUS, "runtime_env": {"env_vars": dict(env_vars)}},
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
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

    `env` is that node's environment (a pod's env): the salt and channel secrets' paths come from it. A
    value of None means the file's location is unknown there (the variable is unset), which no mount can
    fix. The channel secret: an engine refuses to start without it (its KV-event relay), and the ingress's
    router without it hears no KV events and routes on load alone. The embedded tiny model is built
    locally and needs no mount.
    """
    cfg = app_config(config)
    model = cfg["engine"]["model"]
    model_dir = None if model == "tiny" else model
    channel = env.get(CHANNEL_FILE_ENV)
    engine: dict[str, str | None] = {"channel secret": channel}
    ingress: dict[str, str | None] = {"salt secret": env.get(SALT_FILE_ENV), "channel secret": channel}
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


# --- the config against a KubeRay RayService manifest ----------------------------------------------------

# Config keys that only `kvmesh serve` reads (it starts Ray and Serve itself); on KubeRay something else sets
# what they choose, so a value there would mislead its reader.
SET_ELSEWHERE_ON_KUBERAY = {
    "host": "serveConfigV2's http_options (rendered as 0.0.0.0)",
    "port": "serveConfigV2's http_options and the head container's serve port (8000)",
    "proxy": "RAY_SERVE_ENABLE_HA_PROXY in the pods' env",
    "address": "KubeRay itself (the RayService's own Ray cluster)",
}


def pod_groups(service: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A RayService manifest's pod groups: name -> {"template": pod template, "pod": its spec, "params":
    rayStartParams, "max_pods"}."""
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = {
        "head": {
            "template": head["template"],
            "pod": head["template"]["spec"],
            "params": head.get("rayStartParams") or {},
            "max_pods": 1,
        }
    }
    for group in cluster.get("workerGroupSpecs") or []:
        groups[group["groupName"]] = {
            "template": group["template"],
            "pod": group["template"]["spec"],
            "params": group.get("rayStartParams") or {},
            "max_pods": group.get("maxReplicas", group.get("replicas", 1)),
        }
    return groups


def _quantity(value: Any) -> float:
    """`quantity`, raising ValueError on what is not one (a CPU or GPU count is required where it is read)."""
    q = quantity(value)
    if q is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return q


# Kubernetes quantity suffixes (k8s.io/apimachinery resource.Quantity): binary, decimal SI, and the milli of
# a CPU count; a number may also carry a decimal exponent (1e9, 12E6)
_QUANTITY_SUFFIXES = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "": 1,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
}
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)")


def quantity(value: Any) -> float | None:
    """A Kubernetes quantity in its base unit (memory `160Gi`, `128G`, `512Mi`, `1e9` in bytes; CPUs `500m`,
    `2` in cores); None when it is not one. `G` is 10**9 and `Gi` 2**30, as Kubernetes reads them."""
    match = _QUANTITY.fullmatch(str(value).strip())
    if not match:
        return None
    return float(match.group(1)) * _QUANTITY_SUFFIXES[match.group(2)]


def _custom_resources(params: Mapping[str, Any]) -> dict[str, float]:
    """rayStartParams' `resources`: KubeRay takes it as a quoted JSON string, '"{\\"Custom\\": 1}"'."""
    value: Any = params.get("resources")
    try:
        while isinstance(value, str):
            value = json.loads(value)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser recurses
        return {}
    return {str(k): float(v) for k, v in value.items()} if isinstance(value, dict) else {}


def ray_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """What KubeRay hands the pod's raylet: num-cpus/num-gpus start params, else the container limits. A
    CPU limit is rounded up to whole CPUs, as KubeRay does (`--num-cpus` is the quantity's `Value()`,
    which rounds up: 7500m gives 8)."""
    container = group["pod"]["containers"][0]
    spec = container.get("resources") or {}
    limits = {**(spec.get("requests") or {}), **(spec.get("limits") or {})}
    params = group["params"]
    if "num-cpus" in params:
        cpus = _quantity(params["num-cpus"])
    else:  # to nanocores (a quantity's finest unit) first: 15000000u reads as 15.000000000000002 in floats
        cpus = math.ceil(round(_quantity(limits.get("cpu", 0)), 9))
    gpus = _quantity(params["num-gpus"]) if "num-gpus" in params else _quantity(limits.get("nvidia.com/gpu", 0))
    return {**_custom_resources(params), "CPU": cpus, "GPU": gpus}


def fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in need.items())


def landing_groups(config: Mapping[str, Any], service: Mapping[str, Any]) -> dict[str, list[str]]:
    """deployment -> the manifest's pod groups one of its replicas fits on."""
    groups = pod_groups(service)
    return {
        dep: [name for name, group in groups.items() if fits(need, ray_resources(group))]
        for dep, need in actor_resources(config).items()
    }


def container_env(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The environment a pod's Ray container sets: name -> value (None: set from elsewhere, or no value)."""
    return {e["name"]: e.get("value") for e in pod["containers"][0].get("env") or []}


def env_from_elsewhere(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's Ray container also takes variables whose names the manifest does not list (`envFrom`: a
    Secret's or ConfigMap's keys): a variable missing from `container_env` may be set there, so a check that
    needs it can neither find it nor say it is missing."""
    return bool(pod["containers"][0].get("envFrom"))


def _mount_dirs(pod: Mapping[str, Any]) -> list[str]:
    container = pod["containers"][0]
    volumes = {v["name"] for v in pod.get("volumes") or []}
    return [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts") or [] if m["name"] in volumes]


def missing_files(config: Mapping[str, Any], service: Mapping[str, Any]) -> list[str]:
    """'deployment on group: what (path)' for every file a deployment would not find where it can land."""
    groups = pod_groups(service)
    problems = []
    for dep, names in landing_groups(config, service).items():
        for name in names:
            pod = groups[name]["pod"]
            env = container_env(pod)
            mounts = _mount_dirs(pod)
            for what, path in files_read(config, env)[dep].items():
                if path is None and env_from_elsewhere(pod):
                    continue  # its variable may come from the container's envFrom: where it points is unknown here
                if path is None or not any((path.rstrip("/") + "/").startswith(m) for m in mounts):
                    problems.append(f"{dep} on {name}: {what} ({path})")
    return problems


def engine_capacity(config: Mapping[str, Any], service: Mapping[str, Any]) -> float:
    """How many engine replicas the pod groups hold at their maximum size (inf: a replica asks for nothing)."""
    need = {k: v for k, v in actor_resources(config)[ENGINE].items() if v}
    if not need:
        return math.inf
    groups = pod_groups(service)
    capacity = 0
    for name in landing_groups(config, service)[ENGINE]:
        have = ray_resources(groups[name])
        capacity += min(math.floor(have[k] / v) for k, v in need.items()) * groups[name]["max_pods"]
    return capacity


def l1_problems(config: Mapping[str, Any], service: Mapping[str, Any]) -> list[str]:
    """An LMCache L1 (`engine.lmcache.l1_size_gb`, GiB: LMCache sizes it as l1_size_gb * 2**30 bytes) at or
    above the memory limit of a pod group the engines land on: the node's LMCache server holds its L1 in
    that pod's memory, so the pod would be OOM-killed once the L1 filled. Only the limit itself is the rule:
    the engine process and Ray need memory beside the L1 too, but how much depends on the model and the
    engine, so room for them is left to whoever sizes the pods (docs/kubernetes.md)."""
    from kvmesh.kvstore.tiers import TierConfig

    lmcache = (config.get("engine") or {}).get("lmcache")
    if not isinstance(lmcache, Mapping):  # no tiers: no L1
        return []
    l1_gb = lmcache.get("l1_size_gb", TierConfig.l1_size_gb)
    groups = pod_groups(service)
    problems = []
    for name in landing_groups(config, service)[ENGINE]:
        limits = (groups[name]["pod"]["containers"][0].get("resources") or {}).get("limits") or {}
        if "memory" not in limits:  # no limit: the node's memory is the pod's
            continue
        limit = quantity(limits["memory"])
        if limit is None:
            problems.append(f"pod group {name}: memory limit {limits['memory']!r} is not a Kubernetes quantity")
        elif not float(l1_gb) * 2**30 < limit:
            problems.append(
                f"engine.lmcache.l1_size_gb {l1_gb} GiB is not below the memory limit {limits['memory']} "
                f"({limit / 2**30:g} GiB) of pod group {name}, where engines land: the node's LMCache server "
                "holds its L1 in the pod's memory; lower l1_size_gb or raise the limit"
            )
    return problems


# Kubernetes' terminationGracePeriodSeconds where a pod spec leaves it out
DEFAULT_GRACE_PERIOD_S = 30


def drain_problems(config: Mapping[str, Any], service: Mapping[str, Any]) -> list[str]:
    """A pod group the engines land on whose terminationGracePeriodSeconds is not above
    `engine.drain_timeout_s`: a pod stopped while its engine drains (a node drained, a rolling change) would
    be killed before the engine's requests finish, cutting off what the drain time was meant to keep."""
    drain = app_config(config)["engine"]["drain_timeout_s"]
    groups = pod_groups(service)
    problems = []
    for name in landing_groups(config, service)[ENGINE]:
        grace = groups[name]["pod"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_PERIOD_S)
        if not grace > drain:
            problems.append(
                f"pod group {name}: terminationGracePeriodSeconds {grace} is not above engine.drain_timeout_s "
                f"{drain:g}, the time an engine replica gets to finish its requests: raise it"
            )
    return problems


def l2_access_problems(config: Mapping[str, Any], service: Mapping[str, Any]) -> list[str]:
    """Pod groups the engines may land on without the shared tier's credentials that another such group has: an
    engine there (a CPU engine that fits on the head beside a GPU group) starts a node LMCache server that
    cannot authenticate to the L2, and the manifests' network policy for Valkey admits only the GPU group.
    Read for LMCache's resp adapter (redis://), the one whose credentials come from the pod's environment."""
    from kvmesh.kvstore.tiers import CREDENTIAL_ENV

    lmcache = (config.get("engine") or {}).get("lmcache") or {}
    if _l2_adapter(lmcache.get("l2")) != "resp":
        return []
    groups = pod_groups(service)
    names = landing_groups(config, service)[ENGINE]
    problems = []
    for var in CREDENTIAL_ENV.values():
        have = [name for name in names if var in container_env(groups[name]["pod"])]
        # a group whose container takes a Secret or ConfigMap whole (envFrom) may have it: not known to lack it
        lack = [name for name in names if name not in have and not env_from_elsewhere(groups[name]["pod"])]
        if have and lack:
            problems.append(
                f"engine replicas fit on pod group(s) {', '.join(lack)}, which lack the {var} that "
                f"{', '.join(have)} gives the shared tier (engine.lmcache.l2): an engine there could not "
                f"authenticate to it; pin the engines to {', '.join(have)}: a custom resource in the rayStartParams "
                "`resources` there, asked for in engine.resources"
            )
    return problems


def l2_credentials(l2: Any) -> list[str]:
    """Where an LMCache L2 spelling carries credentials: URL user info, or keys that may hold a secret (each
    adapter names its own: password, aws_secret_access_key, ...; `kvstore.tiers.CREDENTIAL_KEY`)."""
    from kvmesh.kvstore.tiers import CREDENTIAL_KEY, url_credentials

    if isinstance(l2, str) and url_credentials(l2):
        return ["the URL's user info"]
    if isinstance(l2, Mapping):
        return [f"key {key!r}" for key in l2 if CREDENTIAL_KEY.search(str(key))]
    return []


def _secret_value(value: Any) -> bool:
    """Whether a value under a credential-like key could be a secret: a non-empty string or a number (not a
    switch such as `use_token: true`, nor a nested mapping, which is searched itself)."""
    if isinstance(value, bool) or value is None:
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and bool(value.strip()))


def embedded_credentials(value: Any, depth: int = 0) -> list[str]:
    """Where a JSON-like setting (a mapping, a list, a string that is a JSON object or array, a URL) carries
    credentials: keys that may hold a secret (`kvstore.tiers.CREDENTIAL_KEY`) with a value, a URL's user info."""
    from kvmesh.kvstore.tiers import CREDENTIAL_KEY, url_credentials

    if depth > 32:  # deeper than any adapter's settings: refused rather than passed unsearched
        return ["settings nested too deeply to search"]
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if CREDENTIAL_KEY.search(str(key)) and _secret_value(item):
                found.append(f"key {str(key)!r}")
            found += embedded_credentials(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found += embedded_credentials(item, depth + 1)
    elif isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "["):
            try:
                found += embedded_credentials(json.loads(text), depth + 1)
            except (ValueError, RecursionError):
                pass
        elif "://" in text and url_credentials(text):
            found.append("a URL's user info")
    return list(dict.fromkeys(found))


def argv_credentials(args: Any) -> list[str]:
    """Where command-line arguments (engine.lmcache.extra_args, the LMCache server's) carry credentials: a flag
    whose name may name a secret (`--password X`, `--auth-token=X`), or a value holding one
    (`embedded_credentials`: an `--l2-adapter` JSON with a password key, a URL with user info)."""
    from kvmesh.kvstore.tiers import CREDENTIAL_KEY

    if not isinstance(args, (list, tuple)):
        return []
    found: list[str] = []
    for arg in args:
        if not isinstance(arg, str):
            continue
        flag, value = ("", arg)
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
        if flag and CREDENTIAL_KEY.search(flag.lstrip("-")):
            found.append(f"flag {flag}")
        found += [f"{where} in an argument" for where in embedded_credentials(value)]
    return list(dict.fromkeys(found))


def _l2_adapter(l2: Any) -> str | None:
    """The LMCache adapter type an L2 spelling selects ('resp' for redis://, 'valkey', ...), None for none or
    one that is not understood (the config check says why)."""
    from kvmesh.kvstore.tiers import TierConfigError, normalise_l2

    try:
        out = normalise_l2(l2) if isinstance(l2, (str, dict)) else None
    except TierConfigError:
        return None
    return out["type"] if out else None


# How an engine pod gives LMCache's resp adapter (redis://) its credentials without the config carrying them
RESP_SECRET_ADVICE = "give the GPU workers LMCACHE_RESP_PASSWORD (and LMCACHE_RESP_USERNAME) from a Secret"


def l2_problems(l2: Any) -> list[str]:
    """Why the shared tier `l2` cannot run on KubeRay. The Serve config holds it verbatim, so credentials must
    reach the adapter from the engine pods' environment; LMCache's resp adapter (redis://) reads
    LMCACHE_RESP_PASSWORD/USERNAME there, its valkey adapter reads nothing but its own settings (lmcache 0.5.6
    `valkey_l2_adapter`): it could authenticate to the manifest's Valkey (--requirepass) only with the password
    published, so it is refused and redis:// (Valkey speaks the same protocol) is the way."""
    adapter = _l2_adapter(l2)
    where = l2_credentials(l2)
    carries = f" and carries credentials ({', '.join(where)}), which serveConfigV2 would show" if where else ""
    if adapter == "valkey":
        return [
            f"engine.lmcache.l2 selects LMCache's valkey adapter{carries}: that adapter reads a password only from "
            "its own settings, never from the pod's environment, so on KubeRay it cannot authenticate to the "
            "manifest's Valkey without publishing the password in serveConfigV2; use redis://HOST:PORT (LMCache's "
            f"resp adapter, which Valkey answers too) and {RESP_SECRET_ADVICE}"
        ]
    if not where:
        return []
    if adapter == "resp":
        advice = f"remove them and {RESP_SECRET_ADVICE}"
    else:
        advice = (
            f"remove them; LMCache's {adapter} adapter must find its credentials in the engine pods' environment "
            f"(from a Secret) where it reads any there, or use redis://HOST:PORT and {RESP_SECRET_ADVICE}"
        )
    return [
        f"engine.lmcache.l2 carries credentials ({', '.join(where)}), which serveConfigV2 and Serve's logs of "
        f"the app's args would show: {advice}"
    ]


def kuberay_config_problems(config: Mapping[str, Any]) -> list[str]:
    """What a kvmesh config must not carry into a RayService's serveConfigV2 (it holds the config verbatim):
    `kvmesh serve`'s own keys, credentials (inline API keys; an L2 URL's, adapter's, LMCache server argument's or
    KV connector setting's password), a shared tier that cannot authenticate without publishing one, and a
    route prefix the manifests' scrape of /metrics does not follow."""
    problems = [
        f"config.{key} has no effect on KubeRay, where {what} sets it: remove it"
        for key, what in SET_ELSEWHERE_ON_KUBERAY.items()
        if key in config
    ]
    prefix = config.get("route_prefix", "/")
    if prefix != "/":
        problems.append(
            f"config.route_prefix {prefix!r} moves the ingress's /metrics to {prefix}/metrics, but "
            "k8s/monitoring/podmonitor.yaml scrapes /metrics on the serve port: leave it at '/' on KubeRay "
            "(a path prefix belongs to the HTTP front before Serve)"
        )
    if config.get("api_keys"):
        problems.append(
            "config.api_keys puts API keys in plain text in serveConfigV2 and Serve's logs of the app's args: "
            "remove them and set tenants_file to a tenants file (key digests only, docs/tenants.md) from the "
            "kvmesh-tenants Secret (docs/kubernetes.md)"
        )
    engine = config.get("engine") or {}
    lmcache = engine.get("lmcache") or {}
    problems += l2_problems(lmcache.get("l2"))
    where = argv_credentials(lmcache.get("extra_args"))
    if where:
        problems.append(
            f"engine.lmcache.extra_args carries credentials ({', '.join(where)}), which serveConfigV2, Serve's "
            "logs of the app's args and the LMCache server's command line would show: remove them; put a shared "
            f"tier in engine.lmcache.l2 (redis://HOST:PORT) and {RESP_SECRET_ADVICE}"
        )
    where = embedded_credentials(engine.get("kv_transfer_config"))
    if where:
        problems.append(
            f"engine.kv_transfer_config carries credentials ({', '.join(where)}), which serveConfigV2 and Serve's "
            f"logs of the app's args would show: remove them; put a shared tier in engine.lmcache.l2 "
            f"(redis://HOST:PORT) and {RESP_SECRET_ADVICE}"
        )
    return problems


def kuberay_problems(config: Mapping[str, Any], service: Mapping[str, Any]) -> list[str]:
    """Why the RayService manifest could not run this config: keys it ignores, credentials it would publish,
    deployments no pod fits, files a pod lacks, an LMCache L1 the engines' pods have no memory for, engine pods
    without the shared tier's credentials, an engine pod's grace period within the engines' drain time,
    autoscaling beyond the worker groups. Empty when it can."""
    problems = kuberay_config_problems(config)
    for dep, names in landing_groups(config, service).items():
        if not names:
            problems.append(f"{dep} fits on no pod group (a replica needs {actor_resources(config)[dep]})")
    problems += [f"not mounted: {missing}" for missing in missing_files(config, service)]
    problems += l1_problems(config, service)
    problems += l2_access_problems(config, service)
    problems += drain_problems(config, service)
    most = max_engine_replicas(app_config(config))
    capacity = engine_capacity(config, service)
    if most > capacity:
        problems.append(f"up to {most} engine replicas, but the worker groups hold at most {capacity}")
    return problems

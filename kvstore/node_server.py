"""One LMCache server per Ray node, owned by a named Ray actor that engines on that node find.

Why an actor: the host tier (L1) is per node and must outlive any single engine replica, and Ray is
how kvmesh places things on nodes. The actor is named `kvmesh-lmcache-<node_id>` in namespace
`kvmesh`, pinned to its node (hard NodeAffinity), detached (it survives the replica that created it),
and created with `get_if_exists=True`, so the first engine on a node starts it and the others get the
same one. It needs no CPU reservation: the server's work is memory copies driven by the engines.

The server process is a child of the actor with a parent-death signal, so killing the actor (or Ray
going away) also ends the server instead of leaving it orphaned.

Engine start-up (deployments/engine.py calls `engine_kv_transfer_config`, below):

    host, port = ensure_node_server(tier_config)          # get-or-create this node's server
    kv_transfer_config = kvmesh.kvstore.tiers.kv_transfer_config(host, port)

The endpoint is an ipc:// socket in the actor's private folder (kvstore/lmcache_server.py), which only
processes of kvmesh's user on this node open: the engine replicas are such processes, on this node by the
same scheduling that finds this actor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.cluster.thread_names import name_this_thread
from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup
from kvmesh.kvstore.lmcache_server import LMCacheServer
from kvmesh.kvstore.tiers import TierConfig, TierConfigError, kv_transfer_config, redacted

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

NAMESPACE = "kvmesh"
ACTOR_PREFIX = "kvmesh-lmcache-"
_ACTOR_CLS = None


class NodeServerCore:
    """What the actor does, kept free of Ray so it can be unit-tested in-process."""

    def __init__(self, config: dict, log_dir: str | None = None):
        self.config = TierConfig.from_dict(config)
        self.config_dict = dict(config)
        # A log folder if one is configured; otherwise the server writes to the actor's stderr, which
        # Ray keeps in its session's worker log, so nothing of ours is left in the temp folder.
        folder = log_dir or os.environ.get("KVMESH_LOG_DIR")
        log_path = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            log_path = Path(folder) / f"lmcache-server-{os.getpid()}.log"
        self.server = LMCacheServer(self.config, log_path, inherit_output=True)
        self.server.start()
        self.last_supervise = "ok"
        self._stop = threading.Event()
        # the watchdog's thread and the actor's restart both stop and start the server: one at a time, or two
        # launches could race for its ports and leave one process untracked
        self._lock = threading.Lock()
        if self.config.watch_interval_s > 0:
            threading.Thread(target=self._watch, name="kvmesh-lmcache-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Restart the server when it died or when its shared tier came back (see LMCacheServer.supervise)."""
        name_this_thread("kvmesh-watchdog")
        while not self._stop.wait(self.config.watch_interval_s):
            try:
                with self._lock:
                    if self._stop.is_set():
                        break
                    self.last_supervise = self.server.supervise()
            except Exception as exc:  # keep watching; health() reports the state
                self.last_supervise = f"error: {exc}"[:200]
                log.warning("LMCache watchdog: %s", exc)

    def endpoint(self) -> tuple[str, int]:
        return self.server.endpoint

    def shape(self) -> dict:
        """The settings every engine on the node must agree with."""
        return {"chunk_size": self.config.chunk_size, "l2": self.config.l2}

    def health(self) -> dict:
        return {**self.server.health(), "watchdog": self.last_supervise}

    def tier_metrics(self) -> dict:
        return self.server.tier_metrics()

    def restart(self) -> tuple[str, int]:
        with self._lock:
            return self.server.restart()

    def stop(self) -> None:
        self._stop.set()  # not under the lock: a relaunch in progress gives up on it (`LMCacheServer.stops`)
        self.server.stop()


def _actor_cls():
    global _ACTOR_CLS
    if _ACTOR_CLS is None:
        import ray

        # max_concurrency=1: methods run on the actor's main thread, the thread whose death the
        # server's parent-death signal watches.
        _ACTOR_CLS = ray.remote(num_cpus=0, max_concurrency=1, max_restarts=0)(NodeServerCore)
    return _ACTOR_CLS


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id


def ensure_node_server(
    tier_config: dict | TierConfig, node_id: str | None = None, timeout_s: float = 300.0
) -> tuple[str, int]:
    """Get or create this node's LMCache server actor; return the (host, port) engines connect to.

    Raises TierConfigError when the node's running server has a different chunk size or shared tier
    than asked for (engines would silently miss each other's blocks).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cfg = tier_config if isinstance(tier_config, TierConfig) else TierConfig.from_dict(tier_config)
    as_dict = _to_dict(cfg)
    node_id = node_id or ray.get_runtime_context().get_node_id()
    actor = (
        _actor_cls()
        .options(
            name=actor_name(node_id),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(as_dict, os.environ.get("KVMESH_LOG_DIR"))
    )
    shape, endpoint = ray.get([actor.shape.remote(), actor.endpoint.remote()], timeout=timeout_s)
    if shape != {"chunk_size": cfg.chunk_size, "l2": cfg.l2}:
        theirs = {**shape, "l2": redacted(shape.get("l2"))}
        raise TierConfigError(
            f"node {node_id[:12]} already runs an LMCache server with {theirs}; "
            f"this engine asked for chunk_size={cfg.chunk_size} l2={redacted(cfg.l2)}"
        )
    return tuple(endpoint)


def engine_kv_transfer_config(lmcache: dict, block_size: int) -> dict:
    """Engine start-up hook (deployments/engine.py): this node's LMCache server → kv_transfer_config.

    Validates the tier config against the engine's block size, gets or starts the node's server (the
    actor above), and patches llvmlite so an in-process engine can start next to LMCache (compat). Runs
    inside the engine replica's process, before the engine is built.
    """
    cfg = TierConfig.from_dict(lmcache)
    cfg.check_block_size(block_size)
    patch_llvmlite_dunder_lookup()
    host, port = ensure_node_server(cfg)
    return kv_transfer_config(host, port)


def _to_dict(cfg: TierConfig) -> dict:
    """A TierConfig as the plain dict the actor is created with (TierConfig.from_dict reads it back)."""
    return dataclasses.asdict(cfg)


def node_servers() -> dict[str, ActorHandle]:
    """node id → actor handle for every kvmesh LMCache server actor in the cluster."""
    import ray

    out: dict[str, ActorHandle] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith(ACTOR_PREFIX):
            try:
                out[entry["name"][len(ACTOR_PREFIX) :]] = ray.get_actor(entry["name"], namespace=NAMESPACE)
            except ValueError:  # died between listing and lookup
                continue
    return out


# node id -> the calls of an earlier `tier_status` its server left unanswered past their deadline (a frozen or
# cut-off node): while they still are, it is reported as not answering at once, not waited on again
_UNANSWERED: dict[str, list] = {}
_UNANSWERED_LOCK = threading.Lock()


def _unreachable(error: str) -> dict:
    return {"health": {"healthy": False, "error": error[:200]}, "tiers": {}}


def tier_status(timeout_s: float = 5.0) -> dict[str, dict]:
    """node id → {"health": ..., "tiers": ...} for every node server; unreachable ones say so. Every server is
    asked at once and waited on `timeout_s` in all; one that has not answered an earlier call yet is not
    asked or waited on again (a frozen node would otherwise cost each call the whole timeout)."""
    import ray
    from ray.exceptions import GetTimeoutError

    actors = node_servers()
    out: dict[str, dict] = {}
    asked: dict[str, list] = {}
    with _UNANSWERED_LOCK:
        for node in [n for n in _UNANSWERED if n not in actors]:
            del _UNANSWERED[node]
        earlier = dict(_UNANSWERED)
    for node, actor in actors.items():
        refs = earlier.get(node)
        if refs is not None and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            out[node] = _unreachable("no answer to an earlier status call yet")
            continue
        asked[node] = [actor.health.remote(), actor.tier_metrics.remote()]
    deadline = time.monotonic() + timeout_s
    for node, refs in asked.items():
        try:
            replies: list[dict] = ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
            out[node] = {"health": replies[0], "tiers": replies[1]}
        except Exception as exc:  # a dead actor must not break /metrics
            out[node] = _unreachable(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, GetTimeoutError):
                with _UNANSWERED_LOCK:
                    _UNANSWERED[node] = refs
                continue
        with _UNANSWERED_LOCK:
            _UNANSWERED.pop(node, None)
    return {node: out[node] for node in actors}


def stop_node_servers() -> int:
    """Stop and kill every node server actor (the servers end with them). Returns how many."""
    import ray

    actors = node_servers()
    for actor in actors.values():
        try:
            ray.get(actor.stop.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(actor, no_restart=True)
    return len(actors)


def _grew(last: dict[str, int], node: str, seen: int) -> bool:
    """Has a node's counter grown since the watch last read it (not on the first read)? Records `seen`."""
    grew = node in last and seen > last[node]
    last[node] = seen
    return grew


async def watch_tier_health(tracker, interval_s: float = 1.0, stop=None) -> None:
    """Router background task: keep a `kvmesh.cluster.tier_tracker.TierTracker` in step with the node servers.

    Every `interval_s`: the shared tier counts as up only if every node that has one reaches it
    (`set_shared_up`), a node whose server was restarted (watchdog) loses its host tier in the
    tracker (`node_restarted`), and a node whose server is down (dead process, unreachable actor) or
    gone (the node left the cluster) is dropped from the tracker (`drop_node`) until its engines
    declare it again (a down one, once it serves again). Actor calls are awaited, never blocking the
    router's loop; errors skip a round. `stop` is an optional asyncio.Event.
    """
    import asyncio

    restarts: dict[str, int] = {}
    losses: dict[str, int] = {}
    while stop is None or not stop.is_set():
        try:
            actors = await asyncio.to_thread(node_servers)
            health: dict[str, dict] = {}
            for node, actor in actors.items():
                try:
                    health[node] = await asyncio.wait_for(actor.health.remote(), timeout=5.0)
                except Exception:
                    tracker.drop_node(node, down=True)  # the actor (or its node) does not answer
                    continue
                if not health[node].get("serving", True):
                    tracker.drop_node(node, down=True)  # the server process is dead; the watchdog restarts it empty
                else:
                    tracker.node_serving(node)
            engine_nodes = set(tracker.index.nodes())
            for node in tracker.watched_nodes():
                if node in actors:
                    continue
                if node in engine_nodes:  # its server's actor is gone, its engines are not: down until it serves
                    tracker.drop_node(node, down=True)
                else:  # left the cluster: nothing kept about it, down or not
                    tracker.forget_node(node)
            # a shared tier a node's watchdog found down since this watch last looked may be back empty (a Redis
            # restarted between two looks): what the router marked there is gone
            lost = False
            for node, h in health.items():
                if _grew(restarts, node, h.get("restarts", 0)):
                    tracker.node_restarted(node)
                lost |= _grew(losses, node, h.get("shared_tier_losses", 0))
            ups = [h["shared_tier_up"] for h in health.values() if h.get("shared_tier_up") is not None]
            if lost:
                tracker.set_shared_up(False)
            if ups:
                tracker.set_shared_up(all(ups) and not any(h.get("shared_tier_was_down") for h in health.values()))
        except Exception as exc:  # never let monitoring kill the router
            log.warning("tier health watch: %s", exc)
        await asyncio.sleep(interval_s)

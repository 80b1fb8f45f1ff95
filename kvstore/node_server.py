"""One LMCache server per Ray node, owned by a named Ray actor that engines on that node find.

Why an actor: the host tier (L1) is per node and must outlive any single engine replica, and Ray is
how kvmesh places things on nodes. The actor is named `kvmesh-lmcache-<node_id>` in namespace
`kvmesh`, pinned to its node (hard NodeAffinity), detached (it survives the replica that created it),
and created with `get_if_exists=True`, so the first engine on a node starts it and the others get the
same one. It needs no CPU reservation: the server's work is memory copies driven by the engines.

The server process is a child of the actor with a parent-death signal, so killing the actor (or Ray
going away) also ends the server instead of leaving it orphaned.

Engine start-up (deployments/engine.py calls `engine_lmcache`, below):

    server = connect_node_server(tier_config)             # get-or-create this node's server
    kv_transfer_config = kvmesh.kvstore.tiers.kv_transfer_config(*server.endpoint)
    server.config                                         # the settings that server runs with

A node's server keeps the settings it was started with for as long as it lives: an engine started later
with another config connects to it as it is. A different chunk size or shared tier is refused (the engines
would miss each other's blocks); a different L1 size is not, and the engine models the server's own
(`server.config`), not its config's, for the routers. A new config reaches a node's server only when that
server is restarted: on KubeRay a new RayCluster (`kvmesh k8s render` stamps a digest of the lmcache
settings on the pod templates, so a change rolls one, docs/kubernetes.md), locally a stop of the app.

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
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.cluster.thread_names import name_this_thread
from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup
from kvmesh.kvstore.lmcache_server import LMCacheServer, LMCacheServerError
from kvmesh.kvstore.tiers import TierConfig, TierConfigError, kv_transfer_config, redacted

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

NAMESPACE = "kvmesh"
ACTOR_PREFIX = "kvmesh-lmcache-"
_ACTOR_CLS = None
# What an engine waits for its node's server beyond the server's own start timeout (`start_timeout_s`): the
# actor's worker process has to start and import kvmesh first, on a node busy starting engines.
ACTOR_START_MARGIN_S = 120.0


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
        # new with every actor: a router tells a replaced actor (same name, new server, empty) from the one before
        self.instance = uuid.uuid4().hex
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
        """The settings every engine on the node must agree with (what engines of the previous version ask)."""
        return {"chunk_size": self.config.chunk_size, "l2": self.config.l2}

    def settings(self) -> dict:
        """The whole tier config this server runs with (`TierConfig` as a plain dict, `_to_dict`)."""
        return _to_dict(self.config)

    def health(self) -> dict:
        return {**self.server.health(), "watchdog": self.last_supervise, "instance": self.instance}

    def tier_metrics(self) -> dict:
        return self.server.tier_metrics()

    def restart(self) -> tuple[str, int]:
        with self._lock:
            return self.server.restart()

    def stop(self) -> None:
        # not under the lock: a watchdog step in progress relaunches nothing after it (`LMCacheServer.launch`)
        self._stop.set()
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


@dataclasses.dataclass(frozen=True)
class NodeServerInfo:
    """The node's LMCache server as an engine found it: where to connect, and the settings it runs with
    (those it was started with, which may not be the asking engine's: see `connect_node_server`)."""

    endpoint: tuple[str, int]
    config: TierConfig


def connect_node_server(
    tier_config: dict | TierConfig, node_id: str | None = None, timeout_s: float | None = None
) -> NodeServerInfo:
    """Get or create this node's LMCache server actor; return its endpoint and the settings it runs with.

    A server already running keeps its own settings. Raises TierConfigError when its chunk size or shared
    tier differ from the ones asked for (engines would silently miss each other's blocks). A different L1
    size is accepted: the returned config holds the server's, which is what the node's host tier holds.
    Waits `timeout_s` for the actor (default: the config's `start_timeout_s` plus ACTOR_START_MARGIN_S, as a
    new actor starts its server before it answers); LMCacheServerError when it has not answered by then.
    """
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cfg = tier_config if isinstance(tier_config, TierConfig) else TierConfig.from_dict(tier_config)
    if timeout_s is None:
        timeout_s = cfg.start_timeout_s + ACTOR_START_MARGIN_S
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
    try:
        settings_call = actor.settings.remote()
    except AttributeError:  # a server of the previous version (detached: it may outlive an upgrade) has no settings()
        settings_call = actor.shape.remote()  # its chunk size and shared tier; its L1 size is not told
    try:
        settings, endpoint = ray.get([settings_call, actor.endpoint.remote()], timeout=timeout_s)
    except GetTimeoutError:
        raise LMCacheServerError(
            f"node {node_id[:12]}'s LMCache server (Ray actor {actor_name(node_id)}) did not answer within "
            f"{timeout_s:.0f} s (lmcache start_timeout_s {cfg.start_timeout_s:g} s + {ACTOR_START_MARGIN_S:.0f} s "
            "for the actor's start): raise engine.lmcache.start_timeout_s if LMCache needs longer to start there; "
            "its output is in $KVMESH_LOG_DIR, else in that actor's Ray worker log"
        ) from None
    # an older server's shape lacks the L1 size: the engine's own stands in for it (the routers model that)
    running = TierConfig.from_dict({**as_dict, **settings})
    if (running.chunk_size, running.l2) != (cfg.chunk_size, cfg.l2):
        if (running.chunk_size, redacted(running.l2)) == (cfg.chunk_size, redacted(cfg.l2)):
            differs = f"with chunk_size={running.chunk_size} l2={redacted(running.l2)}, but its shared tier's "
            differs += "credentials differ from this engine's"
        else:
            differs = (
                f"with chunk_size={running.chunk_size} l2={redacted(running.l2)}; this engine asked for "
                f"chunk_size={cfg.chunk_size} l2={redacted(cfg.l2)}"
            )
        raise TierConfigError(
            f"node {node_id[:12]} already runs an LMCache server {differs}. "
            "A node's server keeps the settings it was started with until it is restarted: on KubeRay apply the "
            "manifest `kvmesh k8s render` wrote from the new config, which rolls out a new RayCluster "
            "(docs/kubernetes.md); locally stop the app (it stops the node servers) and start it again"
        )
    return NodeServerInfo(endpoint=(str(endpoint[0]), int(endpoint[1])), config=running)


def engine_lmcache(lmcache: dict, block_size: int) -> tuple[dict, TierConfig]:
    """Engine start-up hook (deployments/engine.py): this node's LMCache server → (kv_transfer_config, the
    tier config that server runs with, which the engine describes to the routers).

    Validates the tier config against the engine's block size, gets or starts the node's server (the
    actor above), and patches llvmlite so an in-process engine can start next to LMCache (compat). Runs
    inside the engine replica's process, before the engine is built.
    """
    cfg = TierConfig.from_dict(lmcache)
    cfg.check_block_size(block_size)
    patch_llvmlite_dunder_lookup()
    server = connect_node_server(cfg)
    return kv_transfer_config(*server.endpoint), server.config


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
    # every server asked at once, then waited for together: one after the other, a cluster's stop took the sum
    # of its servers' exits (seconds each)
    stops: list = []
    for actor in actors.values():
        try:
            stops.append(actor.stop.remote())
        except Exception:
            pass
    if stops:
        ray.wait(stops, num_returns=len(stops), timeout=30)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
    return len(actors)


def _grew(last: dict[str, int], node: str, seen: int) -> bool:
    """Has a node's counter grown since the watch last read it (not on the first read)? Records `seen`."""
    grew = node in last and seen > last[node]
    last[node] = seen
    return grew


def _no_answer(exc: BaseException) -> bool:
    """Is a failed health call one that got no answer (a frozen or cut-off node, whose server's contents are
    likely intact), rather than one whose actor died or failed?"""
    if isinstance(exc, TimeoutError):
        return True
    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:
        return False
    return isinstance(exc, ActorUnavailableError)


async def _ask_health(actor) -> dict:
    return await actor.health.remote()


class _TierWatch:
    """One router's view of the node servers' answers, kept from one round of `watch_tier_health` to the next."""

    def __init__(self, tracker, timeout_s: float):
        self.tracker = tracker
        self.timeout_s = timeout_s
        self.restarts: dict[str, int] = {}  # node -> its server's restarts counter, last read
        self.losses: dict[str, int] = {}  # node -> its server's shared-tier losses, last read
        self.instances: dict[str, object] = {}  # node -> its actor's `instance`, last read
        # node -> a health call not answered yet: not asked again until it is, so a frozen node's actor does not
        # find a call per round queued when it resumes, and is not waited on again each round
        self.calls: dict = {}
        self._asked: dict[str, object] = {}  # node -> the id of the actor its call in `calls` went to

    async def round(self) -> None:
        import asyncio

        tracker = self.tracker
        actors = await asyncio.to_thread(node_servers)
        for node in [n for n in self.calls if n not in actors]:
            _discard(self.calls.pop(node))
        for node in [n for n in self.calls if self._asked.get(n) != _actor_id(actors[n])]:
            _discard(self.calls.pop(node))  # owed by an actor since replaced: the new one is asked now
        for last in (self.restarts, self.losses, self.instances, self._asked):  # node ids are new on every machine
            for node in [n for n in last if n not in actors]:
                del last[node]
        asked = {}
        for node, actor in actors.items():
            if node not in self.calls:
                self.calls[node] = asked[node] = asyncio.ensure_future(_ask_health(actor))
                self._asked[node] = _actor_id(actor)
        node_of = {call: node for node, call in asked.items()}
        health: dict[str, dict] = {}
        # the calls made now share one deadline, each answer handled as it comes; an earlier round's call still
        # unanswered is not waited on again
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        waiting = set(asked.values())
        lost = False
        while waiting:
            done, waiting = await asyncio.wait(
                waiting, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break
            for call in done:
                lost |= self._answered(node_of[call], health)
        for node in list(self.calls):
            if self.calls[node].done():  # an earlier round's call, answered meanwhile
                lost |= self._answered(node, health)
            else:
                tracker.node_unanswering(node)
        engine_nodes = set(tracker.index.nodes())
        for node in tracker.watched_nodes():
            if node in actors:
                continue
            if node in engine_nodes:  # its server's actor is gone, its engines are not: down until it serves
                tracker.drop_node(node, down=True)
            else:  # left the cluster: nothing kept about it, down or not
                tracker.forget_node(node)
        ups = [h["shared_tier_up"] for h in health.values() if h.get("shared_tier_up") is not None]
        if lost:
            tracker.set_shared_up(False)
        if ups:
            tracker.set_shared_up(all(ups) and not any(h.get("shared_tier_was_down") for h in health.values()))

    def _answered(self, node: str, health: dict[str, dict]) -> bool:
        """Apply a node's finished health call to the tracker; adds its reply to `health`. Returns whether its
        shared tier was lost since the last reply: a Redis restarted between two looks may be back empty."""
        tracker = self.tracker
        try:
            h = self.calls.pop(node).result()
        except Exception as exc:
            if _no_answer(exc):
                tracker.node_unanswering(node)
            else:  # the actor (or its node) is gone
                tracker.drop_node(node, down=True)
            return False
        health[node] = h
        # the server that answered before, with its contents: the actor was not replaced, the server not restarted
        intact = (self.restarts.get(node), self.instances.get(node)) == (h.get("restarts", 0), h.get("instance"))
        replaced = self.instances.get(node, h.get("instance")) != h.get("instance")
        self.instances[node] = h.get("instance")
        if replaced:  # a new actor between two looks (the old one died, Ray made another): its server starts empty
            tracker.node_restarted(node)
        if not h.get("serving", True) and h.get("alive") and intact:
            # the same server process, not answering (hung, or too busy to): its contents are likely intact, and
            # read again if it answers before the watchdog restarts it
            tracker.node_unanswering(node)
        elif not h.get("serving", True):
            tracker.drop_node(node, down=True)  # the server process is dead; the watchdog restarts it empty
        else:
            tracker.node_serving(node, intact=intact)
        if _grew(self.restarts, node, h.get("restarts", 0)):
            tracker.node_restarted(node)
        return _grew(self.losses, node, h.get("shared_tier_losses", 0))

    def close(self) -> None:
        for call in self.calls.values():
            _discard(call)
        self.calls.clear()


def _actor_id(actor) -> object:
    """The Ray actor's own id (a handle got again names the same one; a replacement has a new one)."""
    return getattr(actor, "_actor_id", None)


def _discard(call) -> None:
    """Give up on a health call (its exception, if any, is retrieved: asyncio would log it as never seen)."""
    if call.done():
        if not call.cancelled():
            call.exception()
    else:
        call.cancel()


async def watch_tier_health(tracker, interval_s: float = 1.0, stop=None, timeout_s: float = 5.0) -> None:
    """Router background task: keep a `kvmesh.cluster.tier_tracker.TierTracker` in step with the node servers.

    Every `interval_s`, all node servers are asked for their health at once, with `timeout_s` for the round.
    The shared tier counts as up only if every node that has one reaches it (`set_shared_up`); a node whose
    server was restarted (watchdog) loses its host tier in the tracker (`node_restarted`); a node whose server
    does not answer (a frozen or cut-off node, whose contents are likely intact) is read from no more, its
    model kept, until the same server answers again (`node_unanswering`, `node_serving`); a node whose server
    is down (dead process, dead actor) or gone (the node left the cluster) is dropped from the tracker
    (`drop_node`) until its engines declare it again (a down one, once it serves again). Actor calls are
    awaited, never blocking the router's loop; errors skip a round. `stop` is an optional asyncio.Event.
    """
    import asyncio

    watch = _TierWatch(tracker, timeout_s)
    try:
        while stop is None or not stop.is_set():
            try:
                await watch.round()
            except Exception as exc:  # never let monitoring kill the router
                log.warning("tier health watch: %s", exc)
            await asyncio.sleep(interval_s)
    finally:
        watch.close()

"""Run by tests/integration/test_multinode.py in its own process: a real 2-node Ray cluster on this machine
(benchmarks/local_cluster.py), a real redis-server as the shared tier, the kvmesh app deployed onto the
cluster as `kvmesh serve --address` does (one engine replica per node, each node its own LMCache server),
then the worker node freezes (SIGSTOP of its every process) and resumes, a prefix computed on the worker
node is served on the head node from Redis, the worker node is killed, and the head node's LMCache server
is killed. Prints one JSON line of findings.

    python tests/integration/multinode_check.py WORKDIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback


def _poll(fn, timeout_s: float, interval_s: float = 0.5):
    """fn() until it returns something truthy (returned), or the last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    value = fn()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = fn()
    return value


def _lmcache_pid(endpoint: str) -> int | None:
    """The pid of the LMCache server serving `endpoint` (ipc://FOLDER/requests:PORT): the server started with
    that ipc host (its sockets are unix sockets in a private folder, not a TCP port to look up)."""
    import psutil

    host = endpoint.rsplit(":", 1)[0]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "kvmesh.kvstore.lmcache_main" in cmdline and host in cmdline:
            return proc.info["pid"]
    return None


def _node_pids(cluster, i: int) -> list[int]:
    """Every process of node i: its `ray start` process, what that started, and its process group."""
    import psutil

    top = cluster.procs[i].pid
    pids = {top}
    try:
        pids |= {c.pid for c in psutil.Process(top).children(recursive=True)}
    except psutil.NoSuchProcess:
        pass
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == top:
                pids.add(proc.pid)
        except OSError:
            pass
    return sorted(pids)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _freeze_and_resume(cluster, url: str, headers: dict, model: str, send, state, worker_replica: str) -> dict:
    """The worker node freezes: every process of it stopped (SIGSTOP), as a hung or cut-off machine looks to
    the rest of the cluster, which declares it dead only after about a minute. Requests sent meanwhile (some
    with a prefix cached on the worker) and when the router held the worker's replica suspect; those still
    on the worker are moved once it has been suspect for some seconds; then the node resumes (SIGCONT) and
    the suspicion clears. Returns the findings, times in seconds from the freeze."""
    import httpx

    def on_worker(seed: int) -> list[int]:
        """A prefix computed on the worker: cold prompts until one lands there."""
        for k in range(8):
            p = [(i * 6007 + (seed + k) * 7717) % 1000 + 10 for i in range(256)]
            if send(p)["replica"] == worker_replica:
                return p
        raise RuntimeError("no cold prompt went to the worker's replica")

    during, after = on_worker(100), on_worker(200)  # one for requests while frozen, one for after the resume
    before = state()
    out: dict = {"forgotten_before": before["forgotten"], "suspicions_before": before.get("suspicions")}
    worker_node = (before["routing_stats"].get(worker_replica) or {}).get("node_id")
    out["tiers_before"] = {k: before["tiers"].get(k) for k in ("nodes_dropped", "nodes_unanswering", "nodes_restored")}
    out["worker_host_blocks_before"] = (before["tier_nodes"].get(worker_node) or {}).get("host_blocks")
    pids = _node_pids(cluster, 1)
    out["frozen_processes"] = len(pids)
    seen: dict = {"suspect_at": None, "cleared_at": None, "state_s": []}
    stop = threading.Event()
    t_freeze = time.monotonic()
    _signal_all(pids, signal.SIGSTOP)
    try:

        def watch() -> None:  # when the router held the worker's replica suspect, and how long /kvmesh/state took
            with httpx.Client(base_url=url, headers=headers, timeout=30) as sc:
                while not stop.is_set():
                    t0 = time.monotonic()
                    suspect = worker_replica in (sc.get("/kvmesh/state").json()["router"] or {}).get("suspect", [])
                    now = time.monotonic()
                    seen["state_s"].append(round(now - t0, 3))
                    if suspect and seen["suspect_at"] is None:
                        seen["suspect_at"] = round(now - t_freeze, 2)
                    if not suspect and seen["suspect_at"] is not None and seen["cleared_at"] is None:
                        seen["cleared_at"] = round(now - t_freeze, 2)
                    stop.wait(0.2)

        results: list[dict] = []

        def request(k: int) -> None:
            tail = [(k * 131 + i * 17) % 900 + 50 for i in range(40)]
            prompt = during + tail if k % 2 == 0 else [(i * 37 + k * 9973) % 1000 + 3 for i in range(200)]
            rec: dict = {"k": k, "shared": k % 2 == 0, "sent": round(time.monotonic() - t_freeze, 2)}
            try:
                with httpx.Client(base_url=url, headers=headers, timeout=40) as rc:
                    body = {"model": model, "prompt": prompt, "max_tokens": 2}
                    r = rc.post("/v1/completions", json=body)
                rec["status"], rec["replica"] = r.status_code, r.headers.get("x-kvmesh-replica")
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rec["latency"] = round(time.monotonic() - t_freeze - rec["sent"], 2)
            results.append(rec)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        threads = []
        time.sleep(1.0)
        # from +1 s on, every 0.5 s: before the replica becomes suspect and (three at least) after, up to +9 s
        k = after_suspect = 0
        while time.monotonic() - t_freeze < 9.0 and after_suspect < 3:
            if seen["suspect_at"] is not None:
                after_suspect += 1
            threads.append(threading.Thread(target=request, args=(k,), daemon=True))
            threads[-1].start()
            k += 1
            time.sleep(0.5)
        # frozen long enough for the calls sent there before the suspicion to be moved (suspect for 8 s)
        time.sleep(max(0.0, 16.0 - (time.monotonic() - t_freeze)))
    finally:
        _signal_all(pids, signal.SIGCONT)
    out["resumed_at"] = round(time.monotonic() - t_freeze, 2)
    deadline = time.monotonic() + 20
    while seen["cleared_at"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # the router's tier watch found the node's LMCache server unanswering and kept its host-tier model aside;
    # the same server answers again: the model is read again, contents and all
    _poll(lambda: (state()["tiers"].get("nodes_restored") or 0) > (out["tiers_before"]["nodes_restored"] or 0), 15)
    st = state()
    out["tiers_resumed"] = {k: st["tiers"].get(k) for k in ("nodes_dropped", "nodes_unanswering", "nodes_restored")}
    out["worker_host_blocks_resumed"] = (st["tier_nodes"].get(worker_node) or {}).get("host_blocks")
    stop.set()
    watcher.join(timeout=30)
    for t in threads:
        t.join(timeout=40)
    out.update(suspect_at=seen["suspect_at"], cleared_at=seen["cleared_at"], state_s=seen["state_s"])
    out["requests"] = sorted(results, key=lambda r: r["k"])
    # back: a prefix cached on the worker draws its request there again, and nothing was forgotten
    out["after"] = send(after + [7, 8, 9])["replica"]
    st = state()
    out["forgotten_after"], out["replicas_after"] = st["forgotten"], st["replicas"]
    out["suspicions_after"], out["probes"] = st.get("suspicions"), st.get("probes")
    out["moved"] = (st.get("probes") or {}).get("calls_moved_off_suspect")
    return out


def main() -> int:
    root = sys.argv[1]
    os.environ["KVMESH_HOME"] = os.path.join(root, "home")
    os.environ["KVMESH_LOG_DIR"] = os.path.join(root, "logs")
    import httpx

    from kvmesh.benchmarks.local_cluster import CLUSTER_ENV, LocalRayCluster, NodeSpec
    from kvmesh.kvstore.redis_process import RedisServer

    os.environ.update(CLUSTER_ENV)
    os.environ.pop("RAY_ADDRESS", None)
    found: dict = {}
    redis = RedisServer(os.path.join(root, "redis")).start()
    # head: the ingress (0.1 CPU) and one engine; worker: one engine and nothing else (no CPUs to offer)
    cluster = LocalRayCluster(
        os.path.join(root, "ray"), [NodeSpec(1, {"kvmesh_engine": 1}), NodeSpec(0, {"kvmesh_engine": 1})]
    )
    try:
        cluster.start()
        import ray

        from kvmesh.cluster.ports import free_port
        from kvmesh.deployments.app import start_local, stop_local
        from kvmesh.kvstore.node_server import tier_status

        key = "kvm-multinode-key-0123456789"
        cfg = {
            "replicas": 2,
            "policy": "kvmesh",
            "port": free_port(),
            "api_keys": [key],
            "proxy": "serve",
            "routing_stats_period_s": 0.5,
            "address": cluster.address,
            "engine": {
                "model": "tiny",
                "num_cpus": 0,
                "resources": {"kvmesh_engine": 1},
                "num_gpu_blocks_override": 256,
                "lmcache": {"l1_size_gb": 0.05, "chunk_size": 64, "l2": redis.url, "start_timeout_s": 300},
            },
        }
        url = start_local(cfg, timeout_s=900)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
        worker = next(n["NodeID"] for n in nodes if n["NodeID"] != head)
        found["nodes"] = len(nodes)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]

            def state() -> dict:
                return c.get("/kvmesh/state").json()["router"] or {"routing_stats": {}, "replicas": []}

            def send(prompt: list[int]) -> dict:
                r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
                r.raise_for_status()
                return {
                    "replica": r.headers["x-kvmesh-replica"],
                    "request_id": r.headers["x-kvmesh-request-id"],
                    "predicted": int(r.headers.get("x-kvmesh-predicted-cached-tokens", -1)),
                    "cached": r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                }

            def node_of() -> dict:
                return {rid: s.get("node_id") for rid, s in state()["routing_stats"].items()}

            send([11] * 40)  # the ingress's router exists from the first request on
            # both engines up, each on its own node, each node with its own LMCache server
            # a replica's node id is None until its first routing stats carry it
            placed = _poll(
                lambda: (lambda m: m if None not in m.values() and len(set(m.values())) == 2 else None)(node_of()), 120
            )
            found["engine_nodes"] = sorted(placed.values()) if placed else None
            found["lmcache_nodes"] = sorted(tier_status())
            worker_replica = next(rid for rid, n in placed.items() if n == worker)
            # a prefix computed on the worker node: cold prompts until one lands there
            first, prompt = None, None
            for k in range(6):
                prompt = [(i * 7919 + k * 104_729) % 1000 + 10 for i in range(320)]
                first = send(prompt)
                if first["replica"] == worker_replica:
                    break
            found["first"] = first
            _poll(lambda: state()["tiers"]["prefills_recorded"] >= 1 and state()["tier_nodes"].get(worker), 30)
            found["tier_nodes_before"] = state()["tier_nodes"]
            found["freeze"] = _freeze_and_resume(
                cluster, url, {"Authorization": f"Bearer {key}"}, model, send, state, worker_replica
            )
            found["worker_replica"] = worker_replica
            time.sleep(2.0)  # LMCache writes L1 -> L2 (Redis) in the background

            # the worker node leaves for real: its raylet and every process of the node are killed
            cluster.stop_node(1)
            gone = _poll(lambda: worker_replica not in state()["replicas"], 120)
            st = state()
            found["after_node_left"] = {
                "replica_forgotten": bool(gone),
                "replicas": st["replicas"],
                "tier_nodes": st["tier_nodes"],
            }

            # the same prefix on the head node's engine: a shared-tier (Redis) hit, predicted == delivered
            before = tier_status()[head]["tiers"]
            second = send(prompt)
            after = _poll(
                lambda: (lambda t: t if t.get("shared_hit_tokens", 0) > before.get("shared_hit_tokens", 0) else None)(
                    tier_status()[head]["tiers"]
                ),
                20,
            )
            found["second"] = second
            found["head_l2_hit_tokens"] = (after or {}).get("shared_hit_tokens", 0) - before.get("shared_hit_tokens", 0)
            decision = next(
                (d for d in reversed(state()["recent_decisions"]) if d["request_id"] == second["request_id"]), None
            )
            found["second_tiers"] = decision["chosen_tiers"] if decision else None
            found["block_size"] = 32

            # the head node's LMCache server dies (kill -9): its host tier leaves the router's view
            _poll(lambda: state()["tiers"]["prefills_recorded"] >= 2, 30)
            found["head_host_blocks_before_kill"] = state()["tier_nodes"].get(head, {}).get("host_blocks", 0)
            endpoint = ray.get(ray.get_actor(f"kvmesh-lmcache-{head}", namespace="kvmesh").health.remote())["endpoint"]
            pid = _lmcache_pid(endpoint)
            found["lmcache_pid_found"] = pid is not None
            if pid is not None:
                os.kill(pid, 9)
                dropped = _poll(lambda: state()["tier_nodes"].get(head, {}).get("host_blocks", 0) == 0, 30, 0.2)
                found["head_dropped_after_kill"] = bool(dropped)
                found["tier_counters"] = state()["tiers"]
        # nothing in flight, and the lost node's replica, pending again with no node to take it, would hold a
        # drain for its count's whole timeout
        stop_local(drain=False)
    except Exception as exc:
        found["error"] = f"{type(exc).__name__}: {exc}"[:800]
        found["trace"] = traceback.format_exc()[-2000:]
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:
            pass
        cluster.stop()
        redis.stop()
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the CPU goes while one workload is served: kvmesh on Ray Serve against a peer router over bare
vLLM servers, by process, on the same machine.

Why: on a machine with a few cores shared by every engine, time to first token under load follows the
CPU each request costs, so a TTFT gap to a peer is the sum of what each process of the serving path
spends. This replays one workload-family draw (the live robustness sweep's settings: engine block size
32, the draw's concurrency, token prompts, streaming, 16 output tokens) through each setup and sums the
CPU time of this process and every descendant between the first request and the last answer, grouped by
role (engine replicas, ingress replicas, Serve's controller and proxy, HAProxy, Ray's daemons; the bare
servers and the peer router); the engine replicas, the ingress replicas and the bare servers also by
thread (kvmesh-step: vLLM's own work in an engine replica). Run it with nothing else on the machine:

    .venv/bin/python -m kvmesh.benchmarks.cpu_split [--seed 2005] [--setups kvmesh,peer]

"This process" holds the replay client, and for kvmesh also the Ray driver that started the app.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import psutil

from kvmesh.cluster.thread_names import os_thread_name

ROLES = (  # first match wins: vLLM's own "EngineCore" before kvmesh's "Engine" deployment
    ("kvmesh.kvstore.lmcache_main", "LMCache server"),
    ("redis-server", "Redis"),
    ("EngineCore", "bare vLLM servers"),
    ("api_server", "bare vLLM servers"),
    ("Engine", "engine replicas"),
    ("Ingress", "ingress replicas"),
    ("ServeController", "Serve controller"),
    ("ProxyActor", "Serve proxy actor"),
    ("haproxy", "HAProxy"),
    ("raylet", "Ray daemons"),
    ("gcs_server", "Ray daemons"),
    ("log_monitor", "Ray daemons"),
    ("dashboard", "Ray daemons"),
    ("runtime_env", "Ray daemons"),
    ("monitor", "Ray daemons"),
    ("vllm::router", "peer router"),
    ("vllm-router", "peer router"),
    ("vllm_router", "peer router"),
    ("sglang", "peer router"),
)


def role(name: str, cmdline: str, client_pid: int, pid: int) -> str:
    """The role of one process, by its name and command line."""
    if pid == client_pid:
        return "this process (client, driver)"
    text = f"{name} {cmdline}"
    for key, label in ROLES:
        if key.lower() in text.lower():
            return label
    return "other Ray workers" if "ray::" in text else name


def cpu_by_pid(root: psutil.Process) -> dict[int, tuple[str, float]]:
    """(role, user + system CPU seconds so far) of `root` and every descendant still alive."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (role(p.name(), " ".join(p.cmdline()), root.pid, p.pid), t.user + t.system)
        except psutil.Error:
            continue
    return out


# roles whose CPU is also split by thread: kvmesh names its own threads in the OS (`cluster/thread_names.py`:
# kvmesh-step is vLLM's work in an engine replica, kvmesh-loop the replica's event loop running kvmesh's
# handlers); a Ray worker's other Python threads (Ray's, a KV connector's) show as `ray::IDLE`. A bare vLLM
# server's engine core names its main thread (VLLM::EngineCor), the API server process runs as `python`.
THREAD_SPLIT_ROLES = ("engine replicas", "ingress replicas", "bare vLLM servers", "this process (client, driver)")


def thread_cpu(pid: int, label: str) -> dict[tuple[int, int], tuple[str, float]]:
    """("`label`: OS thread name", user + system CPU seconds so far) per thread of process `pid`, keyed by
    (pid, thread id); {} once the process is gone."""
    try:
        threads = psutil.Process(pid).threads()
    except psutil.Error:
        return {}
    out = {}
    for t in threads:
        name = os_thread_name(t.id, pid)
        if name is not None:  # None: the thread ended, or no /proc here
            out[(pid, t.id)] = (f"{label}: {name}", t.user_time + t.system_time)
    return out


def threads_of(snapshot: dict[int, tuple[str, float]]) -> dict:
    """`thread_cpu` of every process in a `cpu_by_pid` snapshot whose role is split by thread."""
    out: dict = {}
    for pid, (label, _) in snapshot.items():
        if label in THREAD_SPLIT_ROLES:
            out.update(thread_cpu(pid, label))
    return out


def cpu_between(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per role spent between two `cpu_by_pid` snapshots (a process started in between counts
    from zero)."""
    spent: collections.Counter = collections.Counter()
    for pid, (label, t) in after.items():
        spent[label] += t - (before[pid][1] if pid in before else 0.0)
    return dict(spent)


def _measured(send: Callable[[], dict]) -> dict:
    me = psutil.Process()
    before = cpu_by_pid(me)
    threads_before, t0 = threads_of(before), time.perf_counter()
    summary = send()
    after, wall = cpu_by_pid(me), time.perf_counter() - t0
    threads = cpu_between(threads_before, threads_of(after))
    return {"summary": summary, "wall_s": wall, "cpu_s": cpu_between(before, after), "thread_cpu_s": threads}


def run_kvmesh(recs: list[dict], d, replicas: int, tier: bool = False) -> dict:
    """kvmesh on a fresh local app; with `tier`, its engines run with LMCache and a redis-server behind it
    (`robust_live.live_app`)."""
    from kvmesh.benchmarks.robust_live import live_app, replay_config
    from kvmesh.deployments.replay import replay

    with live_app(replicas, "kvmesh", tier=tier) as (url, key):
        time.sleep(3)  # start-up work settles
        cfg = replay_config(url, d, api_key=key)
        return _measured(lambda: replay(recs, cfg).summary())


def run_peer(recs: list[dict], d, replicas: int) -> dict:
    from kvmesh.benchmarks.peers import engines
    from kvmesh.benchmarks.peers.run import replay_through_peer
    from kvmesh.benchmarks.robust_live import PEER, bare_servers, peer_setup, replay_config
    from kvmesh.deployments.replay import replay

    got: dict = {}

    def send(url: str) -> dict:
        time.sleep(3)
        cfg = replay_config(url, d, model=engines.SERVED_MODEL_NAME)
        got.update(_measured(lambda: replay(recs, cfg).summary()))
        return got["summary"]

    with bare_servers(replicas) as (servers, spec, work):
        replay_through_peer(peer_setup(PEER), servers, spec, work / "logs", send)
    return {**got, "setup": PEER}


SETUPS: dict[str, Callable[..., dict]] = {
    "kvmesh": run_kvmesh,
    "peer": run_peer,
    "kvmesh_tier": lambda recs, d, replicas: run_kvmesh(recs, d, replicas, tier=True),
}


def format_run(name: str, res: dict, requests: int) -> str:
    s, cpu = res["summary"], res["cpu_s"]
    total = sum(cpu.values())
    # a setup that answered nothing (every request failed) has no hit rate or TTFT: n/a, not a crash
    hit = "n/a" if s["hit_rate_tokens"] is None else f"{s['hit_rate_tokens']:.3f}"
    ttft = "n/a" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s'] * 1e3:.0f} ms"
    lines = [
        f"{name}: {requests} requests in {res['wall_s']:.1f} s, hit {hit}, errors {s['errors']}, "
        f"TTFT p50 {ttft}; CPU {total:.1f} s ({total / res['wall_s']:.2f} cores), "
        f"{1e3 * total / requests:.0f} ms per request"
    ]
    threads = res.get("thread_cpu_s", {})
    for label, t in sorted(cpu.items(), key=lambda kv: -kv[1]):
        if t >= 0.005 * total:
            lines.append(f"  {t:6.2f} s  {100 * t / total:5.1f}%  {1e3 * t / requests:5.1f} ms/request  {label}")
            split = by_thread(threads, label)
            if split:
                shares = ", ".join(f"{n} {1e3 * v / requests:.1f}" for n, v in split)
                lines.append(f"      by thread, ms/request: {shares}")
    return "\n".join(lines)


def by_thread(threads: dict[str, float], role: str, share: float = 0.02) -> list[tuple[str, float]]:
    """The threads of `role` (`thread_cpu_s` keys "role: name") that spent at least `share` of the role's
    thread CPU, largest first, as (thread name, seconds)."""
    mine = {k.split(": ", 1)[1]: v for k, v in threads.items() if k.startswith(role + ": ")}
    total = sum(mine.values())
    return sorted(((n, v) for n, v in mine.items() if v >= share * total and v > 0), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> int:
    from kvmesh.cluster.workload_family import draw, records

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=2005, help="workload-family draw (default: eval draw 2005)")
    ap.add_argument(
        "--setups", default="kvmesh,peer", help="comma-separated: kvmesh, peer, kvmesh_tier (kvmesh with LMCache)"
    )
    a = ap.parse_args(argv)
    names = [x for x in a.setups.split(",") if x]
    bad = [x for x in names if x not in SETUPS]
    if bad or not names:
        ap.error(f"--setups takes {', '.join(SETUPS)}, not {','.join(bad) or 'nothing'}")
    d = draw(a.seed)
    recs = records(d)
    for name in names:
        res = SETUPS[name](recs, d, d.live_replicas)
        print(format_run(res.get("setup", name), res, len(recs)), flush=True)
    return 0


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

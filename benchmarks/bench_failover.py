"""`BENCH=failover make bench`: an engine replica killed mid-replay loses no request.

Two runs of the same 150-request streaming conversation replay (30 conversations x 5 turns, each
turn extending the last, greedy, 24 tokens each) at concurrency 6 on 3 in-process engine replicas of
one app, as two tenants (their salts keep each run's caches cold): one untouched, then one with a real
`kill -9` of an engine replica while it streams, once a third of the requests completed (failover_run.py).

Targets: 0 failed requests in each run; the stream generating on the killed replica counted as a
migration in /metrics (kvmesh_migrations_total grew by >= 1 during the killed run, and by 0 during the
untouched run: the counter is read before and after each run); the token-weighted hit rate
of the last third of the killed run (by completion order) within 0.05 of the untouched run's.
Also reported: whether every greedy output equals the untouched run's. Writes
BENCH_OUT/failover/bench_failover.json (rewritten after each run, "complete": false until the last).
Environment: BENCH_FAILOVER_REPLICAS, BENCH_FAILOVER_CONVERSATIONS, BENCH_FAILOVER_TURNS,
BENCH_FAILOVER_CONCURRENCY.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx

from kvmesh.benchmarks.failover_run import RunReport, conversations, metric, run
from kvmesh.benchmarks.output import out_dir, write_json
from kvmesh.benchmarks.targets import Targets

MAX_TOKENS = 24
HIT_RATE_TOLERANCE = 0.05
# app-wide /metrics counters, read before and after each run: each run is judged on what it added
COUNTERS = ("kvmesh_migrations_total", "kvmesh_migrations_exhausted_total", "kvmesh_router_replicas_forgotten_total")


def run_app(
    convs,
    replicas: int,
    concurrency: int,
    on_run: Callable[[dict[str, RunReport], dict[str, dict[str, float]]], None] | None = None,
) -> tuple[RunReport, RunReport, dict[str, dict[str, float]]]:
    """Both runs on one app (one start-up): the untouched run as one tenant, the killed run as another,
    whose salt keeps its prefixes apart, so each run starts from cold caches. The counters are per run
    ({"untouched": {name: growth}, "killed": ...}): what each of COUNTERS grew by while that run ran.
    `on_run` is given the reports and counters so far after each run (main keeps them on disk, should the
    next run fail)."""
    import shutil
    import tempfile

    import yaml

    from kvmesh.deployments.app import start_local, stop_local
    from kvmesh.deployments.tenants import hash_api_key

    keys = {run: f"kvm-bench-{run}-" + os.urandom(6).hex() for run in ("untouched", "killed")}
    # both operators: the bench reads the router's state (which replica runs where) with either key
    tenants = [{"id": run, "keys": [{"sha256": hash_api_key(key)}], "operator": True} for run, key in keys.items()]
    folder = tempfile.mkdtemp(prefix="kvmesh-bench-failover-")  # removed when the app stops, below
    tenants_file = os.path.join(folder, "tenants.yaml")
    with open(tenants_file, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"tenants": tenants}, fh)
    config = {
        "replicas": replicas,
        "policy": "kvmesh",
        "port": 0,
        "tenants_file": tenants_file,
        "max_migrations": 3,
        "proxy": "serve",  # the front is not what is measured; Serve's proxy actor starts reliably under load
        "engine": {"model": "tiny", "max_model_len": 1024, "num_cpus": round(1.6 / replicas, 2)},
    }
    t0 = time.perf_counter()
    try:
        # logical CPUs to spare: a replacement engine must be placeable while the killed one is cleaned up
        url = start_local(config, num_cpus=4)
        print(f"{replicas} replicas up in {time.perf_counter() - t0:.0f}s", flush=True)
        reports, counters = {}, {}
        for run_name, kill_at in (("untouched", None), ("killed", 1 / 3)):
            headers = {"Authorization": f"Bearer {keys[run_name]}"}
            before = read_counters(url, headers)
            reports[run_name] = run(
                url, headers, convs, concurrency=concurrency, max_tokens=MAX_TOKENS, kill_at=kill_at
            )
            after = read_counters(url, headers)
            counters[run_name] = {name: after[name] - before[name] for name in COUNTERS}
            print(f"[{run_name}] done in {reports[run_name].wall_s:.0f}s", flush=True)
            if on_run is not None:
                on_run(reports, counters)
        return reports["untouched"], reports["killed"], counters
    finally:
        stop_local()
        shutil.rmtree(folder, ignore_errors=True)  # the tenants file: its key digests leave with the run


def read_counters(url: str, headers: dict) -> dict[str, float]:
    """COUNTERS as /metrics shows them now (both tenants are operators: either key reads them)."""
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        return {name: metric(c, name) for name in COUNTERS}


def write_report(path: str, report: dict, complete: bool) -> None:
    """The JSON report (a temp file renamed over it, so never half-written), rewritten after each run: a
    killed run that fails keeps the untouched run's figures, marked "complete": false."""
    write_json(path, {**report, "complete": complete}, indent=2)


def main() -> None:
    replicas = int(os.environ.get("BENCH_FAILOVER_REPLICAS", 3))
    n_conv = int(os.environ.get("BENCH_FAILOVER_CONVERSATIONS", 30))
    turns = int(os.environ.get("BENCH_FAILOVER_TURNS", 5))
    concurrency = int(os.environ.get("BENCH_FAILOVER_CONCURRENCY", 6))
    convs = conversations(n_conv, turns, seed=2026)
    print(
        f"workload: {n_conv * turns} streaming requests ({n_conv} conversations x {turns} turns), "
        f"concurrency {concurrency}, {replicas} replicas, {MAX_TOKENS} tokens each"
    )
    path = os.path.join(out_dir("failover"), "bench_failover.json")

    def keep(reports: dict[str, RunReport], counters: dict[str, dict[str, float]]) -> None:
        so_far = {name: report.to_json() for name, report in reports.items()}
        write_report(path, {**so_far, "counters": counters}, complete=False)

    keep({}, {})  # no earlier run's complete report left standing
    base, killed, counters = run_app(convs, replicas, concurrency, on_run=keep)
    same_text = sum(a.text == b.text for a, b in zip(base.results, killed.results))
    migrations = counters["killed"]["kvmesh_migrations_total"]
    untouched_migrations = counters["untouched"]["kvmesh_migrations_total"]
    print(
        f"untouched run: {base.failed} failed, hit rate {base.hit_rate():.3f}, "
        f"last third {base.last_third_hit_rate():.3f}, {base.wall_s:.0f}s"
    )
    print(
        f"killed run: replica {killed.killed_replica} (pid {killed.killed_pid}) killed after "
        f"{killed.killed_after} completed requests with {killed.open_on_killed} streams open on it; "
        f"{killed.failed} failed, hit rate {killed.hit_rate():.3f}, last third "
        f"{killed.last_third_hit_rate():.3f}, {killed.wall_s:.0f}s"
    )
    for run_name in ("untouched", "killed"):
        c = counters[run_name]
        print(
            f"during the {run_name} run: migrations {c['kvmesh_migrations_total']:.0f}, exhausted "
            f"{c['kvmesh_migrations_exhausted_total']:.0f}, replicas forgotten "
            f"{c['kvmesh_router_replicas_forgotten_total']:.0f}"
        )
    print(f"greedy outputs equal to the untouched run: {same_text}/{len(base.results)}")
    gap = abs(killed.last_third_hit_rate() - base.last_third_hit_rate())
    targets = Targets()
    rows = [
        ("failed requests (untouched run)", float(base.failed), "== 0", base.failed == 0),
        ("failed requests (killed run)", float(killed.failed), "== 0", killed.failed == 0),
        ("kill landed mid-stream", float(killed.open_on_killed), ">= 1", killed.open_on_killed >= 1),
        # the stream whose token triggered the kill was generating there; other streams the client still
        # read from that replica may have finished in the engine already, and need no move
        ("migrations counted in /metrics (killed run)", migrations, ">= 1", migrations >= 1),
        # nothing failed in the untouched run, so nothing moved: a move there is not the kill's
        ("migrations counted in /metrics (untouched run)", untouched_migrations, "== 0", untouched_migrations == 0),
        # the gap says the killed run kept its cache as well as the untouched one; two runs that never hit
        # the cache would meet it with 0 = 0, so the untouched run must reuse prefixes at all
        ("untouched last-third hit rate", base.last_third_hit_rate(), "> 0", base.last_third_hit_rate() > 0),
        ("last-third hit rate gap", gap, f"<= {HIT_RATE_TOLERANCE}", gap <= HIT_RATE_TOLERANCE),
    ]
    for name, value, need, ok in rows:
        print(f"{targets.verdict(name, ok)}  {name}: {value:.3f} (target {need})")
    write_report(
        path,
        {
            "untouched": base.to_json(),
            "killed": killed.to_json(),
            "counters": counters,
            "greedy_equal": same_text,
            "targets": [{"name": n, "value": v, "target": t, "met": ok} for n, v, t, ok in rows],
        },
        complete=True,
    )
    print(f"wrote {path}")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

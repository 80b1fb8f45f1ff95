"""Live warm start and scale-down of engine replicas, with and without a shared KV tier.

Why: a replica the autoscaler adds starts with an empty engine cache. With LMCache (each node's host
memory as L1, Redis as the shared L2) its first requests on a hot prefix should load that prefix from a
tier instead of recomputing it; and when Serve removes a replica, the prefixes it held should stay
cheap for the others. This bench measures both on real engines.

Each arm starts a fresh app: the tiny model, policy kvmesh, Serve autoscaling on the engine deployment
(min 2, max 3, 1 request in flight per replica as the target), token-id prompts through the HTTP front,
each request one of HOT_PREFIXES hot prefixes + a fresh suffix. Arms:
  shared:    two Ray nodes on this machine (benchmarks/local_cluster.py); the first two engines on the
             head, the second node joins after the warm-up with room for one engine, so the new replica
             lands on a node whose host tier (L1) is empty: only the shared tier (a real redis-server as
             LMCache L2) can warm it;
  no_shared: the same without an L2 (host tiers only): the baseline;
  same_node: one node, L1 + L2: the new replica shares the node's host tier with the old ones.
Phases: warm (CONC_LOW clients send every hot prefix WARM_ROUNDS times; 2 replicas), up (CONC_HIGH
clients; the autoscaler adds a third replica; sending goes on until it served FIRST_N requests or
UP_CAP_S passed), down (CONC_LOW clients, LATE_PREFIXES more prefixes
join, so some live only on the third replica; the autoscaler removes a replica, Serve picks which, see
docs/scale.md; sending goes on until WINDOW requests were sent after the router's replica set shrank).
Load drives the scaling (the autoscaling path, not a redeploy): `serve.run` gives a deployment without
an explicit version a new random code version, so redeploying with another replica count would replace
every replica, warm ones included; the autoscaler changes only the target count.

Figures: the new replica's token hit rate over its first FIRST_N requests, the old replicas' over the same
span, the new replica's first request (cached tokens), the token hit rate over the WINDOW requests
before and after the removal (the dip), and the orphaned prefixes (served only by the replica that left,
so no remaining engine cache holds them) with the hit rate of each one's next request. Targets (shared
against no_shared, both measured in this run):
shared's new-replica hit rate >= no_shared's; shared's new replica is on the node that joined (whose host
tier was empty) and its first request is a shared-tier hit (cached tokens > 0, and that node's LMCache
server counted shared-tier hit tokens, where /metrics gave them); same_node's first request on the new
replica is a tier hit (cached tokens > 0) when that arm runs; shared's dip <= no_shared's + DIP_SLACK;
every arm: its new replica served FIRST_N requests, a replica was removed, no request failed. Writes
BENCH_OUT/warm_start/warm_start.json (rewritten after each arm, "complete": false until the last) and
warm_start.png. Part of `BENCH=scale make bench` (alone:
`BENCH=scale_warm_start make bench`; BENCH_WARM_START_ARMS=shared,no_shared,same_node adds the one-node
arm). About 3 minutes per arm on 2 cores. Exit 1 on a miss.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
import tempfile
import time

from kvmesh.benchmarks.output import out_dir as bench_out
from kvmesh.benchmarks.output import save_plot, write_json
from kvmesh.benchmarks.targets import Targets

HOT_PREFIXES = 8
LATE_PREFIXES = 8  # first sent in the down phase, with 3 replicas: some live only on the one that leaves
BLOCK = 32
PREFIX_TOKENS = 4 * BLOCK  # two LMCache chunks of 64
SUFFIX_TOKENS = 16  # under one block: the suffix is never cached, only the hot prefix can hit
WARM_ROUNDS = 3
CONC_LOW = 1
CONC_HIGH = 4  # fewer clients than needed to saturate: a busy machine starts the new engine sooner
FIRST_N = 100
WINDOW = 40
DIP_SLACK = 0.02  # window-to-window spread of the token hit rate seen here at this load
UP_CAP_S = 240.0  # the new replica has this long (after it starts) to serve FIRST_N requests
JOIN_WAIT_S = 240.0  # for the autoscaler to start the new replica's engine
DOWN_WAIT_S = 120.0  # for the autoscaler to remove a replica
MAX_TOKENS = 1
AUTOSCALING = {
    "min_replicas": 2,
    "initial_replicas": 2,
    "max_replicas": 3,
    "target_ongoing_requests": 1,  # CONC_LOW in flight wants 1 (min 2), CONC_HIGH wants 4 (max 3)
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 10,
}
# shared: two nodes, LMCache L1 + Redis L2, the new replica on the new node (only the shared tier can warm it)
# no_shared: the same without an L2 (the baseline); same_node: one node, L1 + L2 (the node's host tier warms it)
ARMS = ("shared", "no_shared", "same_node")
DEFAULT_ARMS = "shared,no_shared"  # same_node (about 1.5 minutes more) when BENCH_WARM_START_ARMS names it
TWO_NODE_ARMS = ("shared", "no_shared")


# ---- pure parts (tests/unit/benchmarks/test_bench_scale_warm_start.py) ----


def hit_rate(rows: list[dict]) -> float | None:
    """Token hit rate of the rows that succeeded: cached prompt tokens / prompt tokens."""
    ok = [r for r in rows if r.get("ok")]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return sum(r["cached"] for r in ok) / prompt if prompt else None


def new_replica_span(rows: list[dict], new: str, n: int) -> tuple[list[dict], list[dict]]:
    """The new replica's first `n` successful requests (by send time), and the old replicas' requests
    sent between its first and its n-th (the same span of time)."""
    ok = sorted((r for r in rows if r.get("ok")), key=lambda r: r["t0"])
    mine = [r for r in ok if r["replica"] == new][:n]
    if not mine:
        return [], []
    lo, hi = mine[0]["t0"], mine[-1]["t0"]
    return mine, [r for r in ok if r["replica"] != new and lo <= r["t0"] <= hi]


def dip_windows(rows: list[dict], before_end: float, after_start: float, n: int) -> tuple[list[dict], list[dict]]:
    """The last `n` requests finished before `before_end` and the first `n` sent after `after_start`
    (requests in between, around the removal, are in neither)."""
    ok = [r for r in rows if r.get("ok")]
    before = sorted((r for r in ok if r["t1"] < before_end), key=lambda r: r["t1"])[-n:]
    after = sorted((r for r in ok if r["t0"] > after_start), key=lambda r: r["t0"])[:n]
    return before, after


def removal_split(rows: list[dict], removed: list[str], seen_at: float) -> float:
    """When the removal began: the send time of the removed replicas' last request (the router routes
    nothing there once it drains them), or when the shrunk replica set was seen if that is earlier."""
    last = [r["t0"] for r in rows if r.get("ok") and r["replica"] in removed]
    return min([seen_at, *last[-1:]]) if last else seen_at


def orphaned_prefixes(rows: list[dict], removed: list[str], before_end: float) -> list[int]:
    """Prefixes that only the removed replicas had served before the removal: no remaining replica holds
    them in its own cache, so their next requests are tier hits or recomputes."""
    seen: dict[int, set[str]] = {}
    for r in rows:
        if r.get("ok") and r["t1"] < before_end:
            seen.setdefault(r["prefix"], set()).add(r["replica"])
    return sorted(k for k, reps in seen.items() if reps <= set(removed))


def first_after(rows: list[dict], prefixes: list[int], after_start: float) -> list[dict]:
    """Each prefix's first successful request sent after `after_start`."""
    out: dict[int, dict] = {}
    for r in sorted((r for r in rows if r.get("ok") and r["t0"] > after_start), key=lambda r: r["t0"]):
        if r["prefix"] in prefixes:
            out.setdefault(r["prefix"], r)
    return list(out.values())


def dip(before: float | None, after: float | None) -> float | None:
    """How far the hit rate fell across the removal (negative: it rose)."""
    return None if before is None or after is None else before - after


def arm_figures(rows: list[dict], new: str | None, removed_at: float | None, removed: list[str]) -> dict:
    """One arm's figures from its request rows, the new replica's id, when the shrunk replica set was
    seen and which replicas left."""
    mine, old = new_replica_span(rows, new, FIRST_N) if new else ([], [])
    before: list[dict] = []
    after: list[dict] = []
    orphans: list[int] = []
    orphan_next: list[dict] = []
    if removed_at is not None:
        split = removal_split(rows, removed, removed_at)
        before, after = dip_windows(rows, split, removed_at, WINDOW)
        orphans = orphaned_prefixes(rows, removed, split)
        orphan_next = first_after(rows, orphans, removed_at)
    hb, ha = hit_rate(before), hit_rate(after)
    return {
        "requests": len(rows),
        "errors": sum(1 for r in rows if not r.get("ok")),
        "new_replica": new,
        "new_requests": len(mine),
        "new_hit": hit_rate(mine),
        "old_hit_same_span": hit_rate(old),
        "old_requests_same_span": len(old),
        "new_first_cached": mine[0]["cached"] if mine else None,
        "new_first_prompt_tokens": mine[0]["prompt_tokens"] if mine else None,
        "new_cumulative_hit": _cumulative(mine),
        "removed": removed_at is not None,
        "before_hit": hb,
        "after_hit": ha,
        "before_n": len(before),
        "after_n": len(after),
        "dip": dip(hb, ha),
        "orphaned_prefixes": len(orphans),
        "orphan_next_hit": hit_rate(orphan_next),
    }


def _cumulative(rows: list[dict]) -> list[float]:
    out, cached, prompt = [], 0, 0
    for r in rows:
        cached, prompt = cached + r["cached"], prompt + r["prompt_tokens"]
        out.append(round(cached / prompt, 4) if prompt else 0.0)
    return out


def new_node_shared_hits(arm: dict) -> float | None:
    """Shared-tier (L2) hit tokens LMCache counted on the new replica's node (its server's lookups over the
    whole arm), or None where the figure is not there: the node or its tier counters were not read."""
    node = (arm.get("replica_nodes") or {}).get(arm.get("new_replica"))
    by_node = arm.get("tier_hit_tokens_by_node") or {}
    if node is None or node not in by_node:
        return None
    return float(by_node[node].get("shared") or 0.0)


def checks(arms: dict[str, dict]) -> list[tuple[str, bool]]:
    """(target, met): shared against no_shared (both required: a missing arm or figure misses), and
    same_node's first request when that arm ran."""
    t, h = arms.get("shared") or {}, arms.get("no_shared") or {}
    out = []
    for name in ("shared", "no_shared", *(a for a in arms if a not in ("shared", "no_shared"))):
        a = arms.get(name) or {}
        out.append((f"{name}: no failed request", bool(a) and a["errors"] == 0))
        out.append((f"{name}: new replica served {FIRST_N} requests", bool(a) and a["new_requests"] >= FIRST_N))
        out.append((f"{name}: a replica was removed", bool(a) and a["removed"]))
    both = t.get("new_hit") is not None and h.get("new_hit") is not None
    out.append(("warm start: shared new-replica hit >= no_shared's", both and t["new_hit"] >= h["new_hit"]))
    # the arm's premise: the new replica is on the node that joined, whose host tier is empty, so only the
    # shared tier can serve its first request: cached tokens there on an old node prove nothing
    shared_hits = new_node_shared_hits(t)
    first_shared = (
        (t.get("new_first_cached") or 0) > 0
        and bool(t.get("new_node_is_new"))
        and (shared_hits is None or shared_hits > 0)
    )
    out.append(("warm start: shared new replica on the new node, first request a shared-tier hit", first_shared))
    if "same_node" in arms:
        first = arms["same_node"].get("new_first_cached") or 0
        out.append(("warm start: same_node new replica's first request is a tier hit", first > 0))
    dips = t.get("dip") is not None and h.get("dip") is not None
    out.append((f"scale-down: shared dip <= no_shared dip + {DIP_SLACK}", dips and t["dip"] <= h["dip"] + DIP_SLACK))
    return out


def table(arms: dict[str, dict]) -> str:
    def f(v) -> str:
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = [
        f"{'arm':<6} {'new hit':>8} {'old hit':>8} {'new n':>6} {'first cached':>12} "
        f"{'before':>8} {'after':>8} {'dip':>8} {'orphans':>7} {'orph hit':>8} {'requests':>8} {'errors':>6}"
    ]
    for name, a in arms.items():
        first = f"{f(a['new_first_cached'])}/{f(a['new_first_prompt_tokens'])}"
        lines.append(
            f"{name:<6} {f(a['new_hit']):>8} {f(a['old_hit_same_span']):>8} {a['new_requests']:>6} {first:>12} "
            f"{f(a['before_hit']):>8} {f(a['after_hit']):>8} {f(a['dip']):>8} {a['orphaned_prefixes']:>7} "
            f"{f(a['orphan_next_hit']):>8} {a['requests']:>8} {a['errors']:>6}"
        )
    return "\n".join(lines)


# ---- live parts ----


def hot_prefixes(seed: int, n: int) -> list[list[int]]:
    """`n` system prompts of PREFIX_TOKENS token ids each (ids 10..999: the tiny vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(n)]


def app_config(arm: str, key: str, redis_url: str | None, address: str | None) -> dict:
    """The app of one arm: LMCache with Redis as L2 (shared, same_node) or without an L2 (no_shared)."""
    l2 = redis_url if arm in ("shared", "same_node") else "none"
    engine: dict = {
        "model": "tiny",
        "block_size": BLOCK,
        "max_model_len": 512,
        "num_cpus": 0.4,
        "lmcache": {"l1_size_gb": 0.05, "chunk_size": 2 * BLOCK, "l2": l2, "start_timeout_s": 300},
    }
    cfg = {"policy": "kvmesh", "port": 0, "api_keys": [key], "autoscaling": AUTOSCALING, "engine": engine}
    if address:  # two nodes: one engine per `kvmesh_engine` unit, Serve's own proxy (local_cluster.CLUSTER_ENV)
        engine.update(num_cpus=0, resources={"kvmesh_engine": 1})
        cfg.update(address=address, proxy="serve")
    return cfg


class Driver:
    """Sends hot-prefix requests at a set concurrency and records one row per request."""

    def __init__(self, client, model: str, prefixes: list[list[int]], seed: int):
        self.client, self.model, self.prefixes = client, model, prefixes
        self.rng = random.Random(seed)
        self.rows: list[dict] = []
        self.sent = 0

    def prompt(self) -> tuple[int, list[int]]:
        k = self.sent % len(self.prefixes)
        self.sent += 1
        return k, self.prefixes[k] + [self.rng.randrange(10, 1000) for _ in range(SUFFIX_TOKENS)]

    async def one(self, phase: str) -> None:
        k, prompt = self.prompt()
        row = {"phase": phase, "prefix": k, "t0": time.monotonic(), "prompt_tokens": len(prompt), "ok": False}
        try:
            r = await self.client.post(
                "/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS}
            )
            if r.status_code == 200:
                usage = r.json()["usage"]
                row["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                row["prompt_tokens"] = usage["prompt_tokens"]
                row["replica"] = r.headers["x-kvmesh-replica"]
                row["ok"] = True
            else:
                row["error"] = f"{r.status_code} {r.text[:200]}"
        except Exception as exc:  # recorded as a failed request, judged by the targets
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        row["t1"] = time.monotonic()
        self.rows.append(row)

    async def run(self, phase: str, concurrency: int, done) -> None:
        """`concurrency` clients, each sending its next request until `done()` says stop."""

        async def client() -> None:
            while not done():
                await self.one(phase)

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def router_state(client) -> dict:
    r = await client.get("/kvmesh/state")
    return (r.json().get("router") or {}) if r.status_code == 200 else {}


async def replica_ids(client) -> list[str]:
    return list((await router_state(client)).get("replicas") or [])


async def drive(url: str, key: str, seed: int, add_node) -> dict:
    """The three phases on a running app; returns the rows, the new replica and the removal time.
    `add_node` (or None): a blocking call that adds the node the new replica must land on."""
    import httpx

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        prefixes = hot_prefixes(seed, HOT_PREFIXES + LATE_PREFIXES)
        d = Driver(c, model, prefixes[:HOT_PREFIXES], seed + 1)
        target = HOT_PREFIXES * WARM_ROUNDS
        await d.run("warm", CONC_LOW, lambda: d.sent >= target)
        await asyncio.sleep(2.0)  # KV events and tier write-through settle
        initial = set(await replica_ids(c)) | {r["replica"] for r in d.rows if r.get("ok")}
        found: dict = {"initial_replicas": sorted(initial)}
        if add_node is not None:
            t0 = time.monotonic()
            await asyncio.to_thread(add_node)
            found["add_node_s"] = round(time.monotonic() - t0, 1)
        new = await scale_up(c, d, initial, found)
        found["replica_nodes"] = {
            rid: s.get("node_id") for rid, s in ((await router_state(c)).get("routing_stats") or {}).items()
        }
        nodes = found["replica_nodes"]
        found["new_node_is_new"] = bool(new) and nodes.get(new) not in {nodes.get(r) for r in initial}
        d.prefixes = prefixes  # the late prefixes join: placed while the new replica still serves
        removed_at = await scale_down(c, d, found) if new else None
        gone = (initial | {new}) - set(found.get("replicas_after") or []) - {None}
        found["removed_replicas"] = sorted(gone) if removed_at is not None else []
        found.update(rows=d.rows, new=new, removed_at=removed_at)
        return found


async def scale_up(c, d: Driver, initial: set[str], found: dict) -> str | None:
    """CONC_HIGH clients until the new replica served FIRST_N requests; the new replica's id or None."""
    t0 = time.monotonic()
    state: dict = {"new": None, "joined": None}

    def new_count() -> int:
        return sum(1 for r in d.rows if r.get("ok") and r["replica"] == state["new"])

    def done() -> bool:
        if state["new"] is None:
            fresh = [r["replica"] for r in d.rows if r.get("ok") and r["replica"] not in initial]
            if fresh:
                state["new"], state["joined"] = fresh[0], time.monotonic()
            return time.monotonic() - t0 > JOIN_WAIT_S
        return new_count() >= FIRST_N or time.monotonic() - state["joined"] > UP_CAP_S

    await d.run("up", CONC_HIGH, done)
    found["join_s"] = None if state["joined"] is None else round(state["joined"] - t0, 1)
    found["up_s"] = round(time.monotonic() - t0, 1)
    return state["new"]


async def scale_down(c, d: Driver, found: dict) -> float | None:
    """CONC_LOW clients until WINDOW requests were sent after the router's replica set shrank."""
    t0 = time.monotonic()
    state: dict = {"removed_at": None, "sent_at_removal": None}

    async def watch() -> None:
        while state["removed_at"] is None and time.monotonic() - t0 < DOWN_WAIT_S:
            if 0 < len(await replica_ids(c)) < 3:  # an empty answer is a failed look-up, not a removal
                state["removed_at"], state["sent_at_removal"] = time.monotonic(), d.sent
                return
            await asyncio.sleep(0.25)

    def done() -> bool:
        if state["removed_at"] is None:
            return time.monotonic() - t0 > DOWN_WAIT_S
        return d.sent - state["sent_at_removal"] >= WINDOW + CONC_LOW

    await asyncio.gather(watch(), d.run("down", CONC_LOW, done))
    found["down_s"] = None if state["removed_at"] is None else round(state["removed_at"] - t0, 1)
    found["replicas_after"] = await replica_ids(c)
    return state["removed_at"]


async def tier_hits(url: str, key: str) -> dict[str, dict[str, float]]:
    """LMCache's hit tokens by node and tier from /metrics (host = node L1, shared = Redis L2)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        return tier_hits_by_node((await c.get("/metrics")).text)


def tier_hits_by_node(text: str) -> dict[str, dict[str, float]]:
    """node id -> tier -> hit tokens, from `kvmesh_tier_hit_tokens_total{node=...,tier=...}` samples (the
    node id is Ray's, as in the engines' routing stats)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("kvmesh_tier_hit_tokens_total{"):
            node = line.split('node="')[1].split('"')[0] if 'node="' in line else ""
            tier = line.split('tier="')[1].split('"')[0]
            tiers = out.setdefault(node, {})
            tiers[tier] = tiers.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def by_tier(by_node: dict[str, dict[str, float]]) -> dict[str, float]:
    """Hit tokens by tier, summed over nodes."""
    out: dict[str, float] = {}
    for tiers in by_node.values():
        for tier, n in tiers.items():
            out[tier] = out.get(tier, 0.0) + n
    return out


def run_arm(arm: str, seed: int) -> dict:
    """One arm on a fresh app (and a fresh redis-server when it has an L2); the environment is restored
    afterwards (a two-node arm sets the cluster's, a one-node start_local its proxy's)."""
    from kvmesh.kvstore.redis_process import RedisServer

    key = "kvm-warm-" + secrets.token_hex(6)
    work = tempfile.mkdtemp(prefix="kvm-warm-")
    saved = dict(os.environ)
    redis: RedisServer | None = None
    cluster = None
    try:
        if arm != "no_shared":
            redis = RedisServer(os.path.join(work, "redis")).start()
        if arm in TWO_NODE_ARMS:
            cluster = head_only_cluster(work)
        found = serve_and_drive(arm, key, seed, redis.url if redis else None, cluster)
    finally:
        if cluster is not None:
            cluster.stop()
        if redis is not None:
            redis.stop()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(work, ignore_errors=True)
    figures = arm_figures(found["rows"], found["new"], found["removed_at"], found["removed_replicas"])
    extra = {k: v for k, v in found.items() if k not in ("rows", "new", "removed_at")}
    if found["removed_at"] is not None and found["rows"]:  # on the rows' clock (seconds from the first send)
        extra["removal_seen_s"] = round(found["removed_at"] - min(r["t0"] for r in found["rows"]), 3)
    return {"arm": arm, **figures, **extra, "rows": _relative(found["rows"])}


def serve_and_drive(arm: str, key: str, seed: int, redis_url: str | None, cluster) -> dict:
    """start_local (onto `cluster` when given, else a local Ray of its own), the phases, stop_local."""
    import ray

    from kvmesh.benchmarks.local_cluster import patient_node_start
    from kvmesh.deployments.app import start_local, stop_local

    patient_node_start()
    t0 = time.perf_counter()
    url = start_local(app_config(arm, key, redis_url, cluster.address if cluster else None), timeout_s=900)
    try:
        up_s = round(time.perf_counter() - t0, 1)
        found = asyncio.run(drive(url, key, seed, (lambda: add_worker(cluster)) if cluster else None))
        found["tier_hit_tokens_by_node"] = asyncio.run(tier_hits(url, key))
        found["tier_hit_tokens"] = by_tier(found["tier_hit_tokens_by_node"])
    finally:
        stop_local()
        if ray.is_initialized():
            ray.shutdown()
    found["app_up_s"] = up_s
    return found


def head_only_cluster(work: str):
    """A local Ray cluster of one node, the head (the ingress and the first two engines); the new
    replica's node joins later (add_worker)."""
    from kvmesh.benchmarks.local_cluster import CLUSTER_ENV, LocalRayCluster, NodeSpec

    os.environ.update(CLUSTER_ENV)
    os.environ.pop("RAY_ADDRESS", None)
    return LocalRayCluster(os.path.join(work, "ray"), [NodeSpec(1, {"kvmesh_engine": 2})]).start()


def add_worker(cluster) -> None:
    """A second node with room for one engine, joined after the warm-up as a cluster autoscaler would add
    one: the autoscaler's third replica can only land there, on a node whose host tier is empty."""
    from kvmesh.benchmarks.local_cluster import NodeSpec

    cluster.add_node(NodeSpec(0, {"kvmesh_engine": 1}))
    cluster.wait_nodes(2)


def _relative(rows: list[dict]) -> list[dict]:
    """Rows with times in seconds from the first send (for the JSON)."""
    if not rows:
        return []
    base = min(r["t0"] for r in rows)
    return [{**r, "t0": round(r["t0"] - base, 3), "t1": round(r["t1"] - base, 3)} for r in rows]


def plot(arms: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for i, (name, a) in enumerate(arms.items()):
        axes[0].plot(range(1, len(a["new_cumulative_hit"]) + 1), a["new_cumulative_hit"], color=f"C{i}", label=name)
    axes[0].set(
        title=f"new replica: cumulative token hit rate, first {FIRST_N}",
        xlabel="its n-th request",
        ylabel="token hit rate so far",
    )
    axes[0].legend()
    names = list(arms)
    for ax, keys, title in (
        (axes[1], ("new_hit", "old_hit_same_span"), "warm start: new vs old replicas"),
        (axes[2], ("before_hit", "after_hit"), f"scale-down: {WINDOW} requests before / after"),
    ):
        for j, k in enumerate(keys):
            xs = [x + 0.4 * j for x in range(len(names))]
            shown = [(x, arms[n].get(k)) for x, n in zip(xs, names) if arms[n].get(k) is not None]
            ax.bar([x for x, _ in shown], [v for _, v in shown], width=0.4, label=k, color=f"C{j + 2}")
            for x, n in zip(xs, names):
                if arms[n].get(k) is None:  # no figure (nothing served in that span): n/a, not a 0 hit rate
                    ax.bar(x, 0.05, width=0.4, fill=False, hatch="//", edgecolor=f"C{j + 2}")
                    ax.text(x, 0.05, "n/a", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([x + 0.2 for x in range(len(names))], names)
        ax.set(title=title, ylabel="token hit rate", ylim=(0, 1))
        ax.legend(fontsize=7)
    save_plot(fig, path)


def write_report(path: str, arms: dict[str, dict], complete: bool) -> None:
    """The JSON report, rewritten after every arm (a temp file renamed over it, so never half-written): a
    later arm that fails keeps the arms measured so far, marked "complete": false."""
    report = {"arms": arms, "autoscaling": AUTOSCALING, "first_n": FIRST_N, "window": WINDOW, "complete": complete}
    write_json(path, report)


def main() -> None:
    targets = Targets()
    out_dir = bench_out("warm_start")
    json_path = os.path.join(out_dir, "warm_start.json")
    wanted = (os.environ.get("BENCH_WARM_START_ARMS") or DEFAULT_ARMS).split(",")
    arms: dict[str, dict] = {}
    write_report(json_path, arms, complete=False)  # no earlier run's complete report left standing
    for arm in (a for a in ARMS if a in wanted):
        t0 = time.perf_counter()
        print(f"  {arm}: 2 replicas, autoscaling to 3 and back ...", flush=True)
        arms[arm] = run_arm(arm, seed=1000)  # the same prompts in every arm (each has its own caches)
        write_report(json_path, arms, complete=False)
        a = arms[arm]
        print(
            f"    new replica hit {a['new_hit']} over {a['new_requests']}, dip {a['dip']}, "
            f"{a['errors']} errors ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    print(
        f"\nwarm start / scale-down: {HOT_PREFIXES} hot prefixes (+{LATE_PREFIXES} from the down phase) of "
        f"{PREFIX_TOKENS} tokens + {SUFFIX_TOKENS}, "
        f"concurrency {CONC_LOW}/{CONC_HIGH}, new replica's first {FIRST_N}, windows of {WINDOW}"
    )
    print(table(arms))
    t, h = arms.get("shared", {}), arms.get("no_shared", {})
    if t.get("new_hit") is not None and h.get("new_hit") is not None:
        print(f"  new-replica hit, shared - no_shared: {t['new_hit'] - h['new_hit']:+.4f}")
    for name, a in arms.items():
        print(
            f"  {name}: LMCache hit tokens by tier {a.get('tier_hit_tokens')}, new replica's node is "
            f"{'new' if a.get('new_node_is_new') else 'an old one'} (shared-tier hit tokens there: "
            f"{new_node_shared_hits(a)}), removed {a.get('removed_replicas')}"
        )
    for name, ok in checks(arms):
        print(f"  {name}: {targets.verdict(name, ok)}")
    write_report(json_path, arms, complete=True)
    plot(arms, os.path.join(out_dir, "warm_start.png"))
    print(f"wrote {out_dir}/warm_start.json and warm_start.png")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

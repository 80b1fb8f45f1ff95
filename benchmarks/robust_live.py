"""Live half of the robustness sweep: family draws (the first family's eval draws, or the second family's
wide_eval draws of 3-4 replicas) replayed on real engines, each compared with the simulator's prediction for
the same send order.

Why: the simulator is how a policy change is judged before a live run, so it must predict what the
live router does. Per draw, kvmesh and round robin each get a fresh local app (vLLM engines at block
size 32, the draw's tokens per block, 3-4 replicas as the draw says); the replay client sends the
records in order under the draw's concurrency cap (4 for timed draws), a user's next turn after its
previous reply, token-id prompts, streaming; vllm-router's cache_aware policy gets the same replay over
as many bare vLLM servers with the same engine settings. The simulator sends the same records with its closed-loop
client (`kvmesh.cluster.simulator.ClosedLoop`: the same concurrency, the same per-user order), each request
decoding what the replay asks of it (`LIVE_MAX_TOKENS`).
Reported per draw: hit rate, per-replica requests and prefill (uncached prompt tokens), prefill
max/mean, TTFT p50, the infinite-cache and balance-bounded bounds, and the sim-vs-live
differences, down to the share of requests the simulator places as the live router did.

TTFT is also judged in the simulator: kvmesh and round robin, each sent in the live send order, on the
simulator's capacity model (one accelerator per replica), without a tier and, where the live runs have
LMCache, with a shared tier. Why: on a small machine the 3-4 live engines
share a few CPU cores, so a live p50 measures their contention as much as the placement; the simulated
p50 is what the placement does to TTFT where each replica has its own accelerator.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from itertools import permutations
from pathlib import Path
from typing import Any

from kvmesh.benchmarks.peers.results import max_over_mean
from kvmesh.cluster import workload_family, workload_wide
from kvmesh.cluster.bounds import balance_bounded_bound, infinite_hit_rate
from kvmesh.cluster.decision_trace import decision, first_divergence, format_divergence, ranking_cells
from kvmesh.cluster.exact_placement import decide_target
from kvmesh.cluster.simulator import ClosedLoop, SimConfig, simulate_policy
from kvmesh.cluster.trace import Trace
from kvmesh.cluster.workload_family import FamilyDraw, draw, records
from kvmesh.cluster.workload_wide import WideDraw
from kvmesh.cluster.workloads import engine_trace
from kvmesh.policies.registry import make_policy

ENGINE_BLOCK = 32
TIMED_CONCURRENCY = 4  # live draws are all sent under a concurrency cap; timed patterns use this one
# output tokens each live request asks for (the replay's `max_tokens`, capping the draw's scaled output length);
# the simulations of those runs decode as many (`engine_trace(max_tokens=...)`), or they would predict another
# workload: longer decodes hold sequence slots and delay each user's next turn
LIVE_MAX_TOKENS = 16
PEER = "vllm-router/cache_aware"  # the peer the live target compares with (it piles up to reach its hit rate)
# the workload families a live row's seed can be a draw of: the first family (`workload_family`, its tune and
# eval seeds) and the one with shapes it never draws (`workload_wide`, its wide_eval seeds)
FAMILIES = {"family": workload_family, "wide": workload_wide}
Draw = FamilyDraw | WideDraw


def live_replicas(d: Draw) -> int:
    """How many engine replicas a draw runs on live: the first family draws 3-4 for that; a wide draw runs on
    its own fleet (only those of 3-4 replicas are run live, `wide_live_seeds`)."""
    return d.live_replicas if isinstance(d, FamilyDraw) else d.replicas


def wide_live_seeds(seeds: Sequence[int]) -> list[int]:
    """The wide draws of `seeds` that can run live as drawn: a fleet of 3 or 4 replicas, as the live runs of
    the first family have (the selection depends on the draw's shape only, never on a result)."""
    return [s for s in seeds if workload_wide.draw(s).replicas in (3, 4)]


def live_concurrency(d: Draw) -> int:
    """How many requests a live run of the draw keeps in flight: an `all` draw's own cap; a timed draw
    (poisson, bursts) is sent in timestamp order at `TIMED_CONCURRENCY`, its timestamps otherwise unused (its
    arrival pattern is exercised only in the simulator)."""
    return d.concurrency if d.arrival == "all" else TIMED_CONCURRENCY


def replay_config(url: str, d: Draw, api_key: str | None = None, model: str | None = None):
    """How every live run of a draw is sent (kvmesh, round robin, a peer router): the draw's tokens per
    block and concurrency cap, `LIVE_MAX_TOKENS` output tokens at most, no progress bar."""
    from kvmesh.deployments.replay import ReplayConfig

    return ReplayConfig(
        url=url,
        model=model,
        tokens_per_block=d.tokens_per_block,
        concurrency=live_concurrency(d),
        api_key=api_key,
        max_tokens=LIVE_MAX_TOKENS,
        progress=False,
    )


def simulate_in_send_order(
    recs: list[dict],
    d: Draw,
    replicas: int,
    policy: str,
    shared: bool = False,
    chunk_blocks: int = 1,
    jitter_s: float = 0.0,
    seed: int = 0,
) -> dict:
    """The simulator on the records, sent as the replay client sends them (with an unbounded shared tier
    behind every replica when `shared`, a block loadable from it once its prefill has ended, in LMCache
    chunks of `chunk_blocks` engine blocks; each send `jitter_s` at most late, seeded by `seed`:
    `ClosedLoop.jitter_s`). Each request decodes what the live replay asks of it (`LIVE_MAX_TOKENS` at most,
    `replay_config`)."""
    trace = engine_trace(recs, d.tokens_per_block, ENGINE_BLOCK, name=f"family-{d.seed}", max_tokens=LIVE_MAX_TOKENS)
    blocks = sum(len(r.hash_ids) for r in trace.requests) + 1
    placed: list[tuple[int, str]] = []  # (record index, replica) in the order the simulator routes them
    decisions: list[dict] = []  # what ranking saw, per placement (`decision_trace`)
    chosen = make_policy(policy)
    routed, best = chosen.on_routed, chosen.best

    def rank(request, fleet):
        j = best(request, fleet)
        if j is not None:  # read before `on_routed` credits it, as the live router does
            decisions.append(decision(int(request.request_id), fleet.ids[j], ranking_cells(chosen, fleet, j)))
        return j

    def record(request, replica_id, view=None):
        placed.append((int(request.request_id), replica_id))
        routed(request, replica_id, view)

    chosen.best = rank  # type: ignore[method-assign]
    chosen.on_routed = record  # type: ignore[method-assign]
    res = simulate_policy(
        trace,
        SimConfig(
            replicas=replicas,
            capacity_blocks=blocks,
            shared=shared,
            tier_store_at="computed",
            tier_chunk_blocks=chunk_blocks,
        ),
        chosen,
        client=ClosedLoop(live_concurrency(d), [r.get("user") for r in recs], jitter_s=jitter_s, seed=seed),
    )
    per = list(res["per_replica"].values())
    return {
        "hit": res["hit_rate_tokens"],
        "requests": sorted(p["requests"] for p in per),
        "prefill": sorted(p["prefill_tokens"] for p in per),
        "prefill_max_over_mean": max_over_mean([p["prefill_tokens"] for p in per]) or 1.0,
        "ttft_p50_s": res["ttft_p50_s"],
        "placement": first_use_names(placed, len(recs)),
        "decisions": decisions,
    }


# how far a simulated run may be from the live one: hit rate, prefill max/mean, per-replica requests (as a
# share of the mean count)
SIM_TOLERANCES = {"hit": 0.02, "prefill_max_over_mean": 0.15, "requests": 0.15}
# the jittered simulations per draw, and the most each send is late. Why 5 ms: requests sent together
# reach the live router a few milliseconds apart (the decision traces); 5, 20 and 50 ms cover the saved
# live runs alike (61 of 72 draws within every tolerance of one of 16 runs, 57 for the one run without
# jitter; 62 and 65 with two other sets of 16 seeds, 67 with 64 runs), so the spread comes from the order
# of near-simultaneous sends, not from the jitter's size
SPREAD_RUNS = 16
SPREAD_JITTER_S = 0.005


def within_tolerances(diff: dict) -> bool:
    """Is a `compare` result within every one of `SIM_TOLERANCES`? A difference that could not be taken (a
    figure missing on either side) is not within."""
    return all(at_most(diff[k], tol) for k, tol in SIM_TOLERANCES.items())


def at_most(a: float | None, b: float | None) -> bool:
    """a <= b, False where either figure is missing (None: a run none of whose requests succeeded has no hit
    rate or TTFT, and a check that needs one is missed, not passed on a stand-in figure)."""
    return a is not None and b is not None and a <= b


def apart(a: float | None, b: float | None) -> float | None:
    """|a - b|; None where either figure is missing."""
    return None if a is None or b is None else abs(a - b)


def fmt_figure(x: float | None, spec: str, scale: float = 1.0) -> str:
    """`x * scale` formatted by `spec`; a missing figure (None) as "-", right-aligned in the width `spec` names
    (a table's column stays aligned)."""
    width = spec[: len(spec) - len(spec.lstrip("0123456789"))]
    return format(x * scale, spec) if x is not None else format("-", ">" + width)


def simulated_spread(
    recs: list[dict], d: Draw, replicas: int, runs: int = SPREAD_RUNS, jitter_s: float = SPREAD_JITTER_S
) -> list[dict]:
    """kvmesh simulated `runs` times in the live send order, each send up to `jitter_s` late (seeds 1 to
    `runs`): the outcomes send timing alone produces. Why: a live run is one draw of that timing, so one
    simulated run can match it only where the placement does not turn on it; where it does, the question
    is whether the live outcome is among the simulated ones. Per run: hit, prefill max/mean, requests."""
    keep = ("hit", "prefill_max_over_mean", "requests")
    runs_out = []
    for seed in range(1, runs + 1):
        sim = simulate_in_send_order(recs, d, replicas, "kvmesh", jitter_s=jitter_s, seed=seed)
        runs_out.append({k: sim[k] for k in keep})
    return runs_out


def spread_match(live: dict, spread: list[dict]) -> dict:
    """How many of the jittered simulated runs match the live run within every tolerance, and the range of
    their hit rates and prefill max/mean."""
    hits = [s["hit"] for s in spread]
    mm = [s["prefill_max_over_mean"] for s in spread]
    return {
        "runs": len(spread),
        "within": sum(within_tolerances(compare(live, s)) for s in spread),
        "hit": [min(hits), max(hits)],
        "prefill_max_over_mean": [min(mm), max(mm)],
    }


SIM_PEER = "sglang_cache_aware"  # the simulated stand-in for PEER (vllm-router's cache_aware is a port of it)


def simulated_live_targets(
    seeds: Sequence[int],
    setups: Sequence[tuple[bool, int]] = ((False, 1),),
    policies: Sequence[str] = ("kvmesh", "round_robin"),
) -> list[dict[str, list[int]]]:
    """Per tier set-up, per policy, the draws (of `seeds`) on which the simulator, sending as the live replay
    does at each draw's live replica count, meets the live targets the live runs are judged by: hit >= 0.95 x
    the balance-bounded bound, prefill max/mean <= 1.25, hit >= the cache-aware peer's (simulated, without a
    tier) - 0.03. Why: a live run takes minutes per draw, so only a slice of the evaluation draws runs live;
    where the simulator predicts the live runs (with the shared tier it gave the live hit rate of every live
    draw so far), this judges the live targets on every draw. A set-up is (shared, chunk_blocks): with
    `shared`, an unbounded shared tier in LMCache chunks of `chunk_blocks` engine blocks, the peer without
    one, as it runs live. Each draw's bound and peer are computed once for all set-ups."""
    met: list[dict[str, list[int]]] = [{p: [] for p in policies} for _ in setups]
    for seed in seeds:
        d, recs, trace, floor, peer = _live_target_floors(seed)
        n = d.live_replicas
        for out, (shared, chunk_blocks) in zip(met, setups):
            for p in policies:
                m = simulate_in_send_order(recs, d, n, p, shared=shared, chunk_blocks=chunk_blocks)
                if m["hit"] >= floor and m["prefill_max_over_mean"] <= 1.25 and m["hit"] >= peer:
                    out[p].append(seed)
    return met


def simulated_live_target_verdict(seed: int, exact_s: float = 10.0) -> str:
    """Can any placement of the draw meet the live targets as `simulated_live_targets` judges them (hit >=
    the larger of 0.95 x the balance-bounded bound and the simulated cache-aware peer's less 0.03, prefill
    max/mean <= 1.25)? `exact_placement.decide_target`'s verdict: "reachable", "out of reach" or
    "undecided". Why: the peer reaches its hit rate by piling up, and on some draws no balanced placement
    reaches it; a simulated miss there is the workload's arithmetic, not the policy's. The untimed model
    is exact here: without a tier the simulator counts a prefix cached from the moment it is routed, and
    every replica has room for every block."""
    d, _, trace, floor, peer = _live_target_floors(seed)
    return _decided(trace, d.live_replicas, max(floor, peer), exact_s)[0]


def _live_target_floors(seed: int) -> tuple[FamilyDraw, list[dict], Trace, float, float]:
    """The draw, its records and engine trace, and the two hit rates the simulated live targets ask at its
    live replica count: 0.95 x the balance-bounded bound, and the simulated cache-aware peer's less 0.03."""
    d = draw(seed)
    recs = records(d)
    n = d.live_replicas
    trace = engine_trace(recs, d.tokens_per_block, ENGINE_BLOCK)
    floor = 0.95 * balance_bounded_bound(trace.requests, ENGINE_BLOCK, n)["hit_rate"]
    peer = simulate_in_send_order(recs, d, n, SIM_PEER)["hit"] - 0.03
    return d, recs, trace, floor, peer


def first_use_names(sent: Sequence[tuple[int, str]], n: int) -> list[str]:
    """Each request's replica (by record index; "" where none is known), renamed r0, r1, ... in the order
    the replicas were first used, taking `sent` (record index, replica) in send order. Why: replica names
    differ between two runs, the sequence of placements need not; two runs that place every request
    alike get equal lists."""
    names: dict[str, str] = {}
    out = [""] * n
    for index, replica in sent:
        out[index] = names.setdefault(replica, f"r{len(names)}")
    return out


def placed_alike(live: Sequence[str], sim: Sequence[str]) -> float:
    """The share of requests the two runs placed alike: on replicas matched one to one so that as many
    requests as possible agree. Why matched, not compared by name: two idle replicas are
    interchangeable, so the first two placements may take them in either order, which would rename
    every later placement without moving any request. Exhaustive over matchings up to 7 replicas (a
    live draw has 3-4), greedy by the largest overlaps beyond."""
    pairs = Counter((a, b) for a, b in zip(live, sim) if a and b)
    if not pairs:
        return 0.0
    rows, cols = sorted({a for a, _ in pairs}), sorted({b for _, b in pairs})
    if len(rows) > len(cols):
        rows, cols, pairs = cols, rows, Counter({(b, a): k for (a, b), k in pairs.items()})
    if len(cols) <= 7:
        best = max(sum(pairs[a, b] for a, b in zip(rows, perm)) for perm in permutations(cols, len(rows)))
    else:
        best, used_rows, used_cols = 0, set(), set()
        for (a, b), k in pairs.most_common():
            if a not in used_rows and b not in used_cols:
                best += k
                used_rows.add(a)
                used_cols.add(b)
    return best / sum(pairs.values())


def bounds_for(recs: list[dict], d: Draw, replicas: int, exact_s: float = 30.0) -> dict:
    """The draw's bounds at the live block size, and whether any placement meets the live target
    (hit >= 0.95 x balance-bounded with max/mean <= 1.25; `exact_placement.decide_target`): "reachable"
    makes a live miss the policy's, "out of reach" the workload's."""
    trace = engine_trace(recs, d.tokens_per_block, ENGINE_BLOCK)
    bb = balance_bounded_bound(trace.requests, ENGINE_BLOCK, replicas)
    verdict, placement = _decided(trace, replicas, 0.95 * bb["hit_rate"], exact_s)
    return {
        "infinite": infinite_hit_rate(trace.requests, ENGINE_BLOCK),
        "balance": bb["hit_rate"],
        "balance_imbalance": bb["imbalance"],
        "target_verdict": verdict,
        "target_placement": placement,
    }


def _decided(trace, replicas: int, hit: float, exact_s: float) -> tuple[str, list[float] | None]:
    """Does any placement of `trace` on `replicas` reach `hit` with prefill max/mean <= 1.25
    (`exact_placement.decide_target`)? (verdict, [hit, max/mean] of the placement found, or None)."""
    exact = decide_target(trace.requests, ENGINE_BLOCK, replicas, hit, 1.25, exact_s)
    got = exact["replayed"]
    return exact["verdict"], [got["hit_rate"], got["imbalance"]] if got else None


@contextmanager
def live_app(replicas: int, policy: str, log=print, tier: bool = False) -> Iterator[tuple[str, str]]:
    """A fresh local kvmesh app (the robustness settings: tiny model, block size 32, context 4096) with
    `policy`; yields (url, api key) and stops the app on leaving. With `tier`, the engines run with
    LMCache (its host tier, shared by every replica on the node, and a fresh redis-server behind it as
    the shared tier; chunks of one engine block, so a tier hit is as fine-grained as the engine's own)."""
    from kvmesh.deployments.app import start_local, stop_local

    key = "kvm-robust-" + secrets.token_hex(6)
    engine: dict[str, Any] = {"block_size": ENGINE_BLOCK, "max_model_len": 4096}
    config = {"replicas": replicas, "policy": policy, "port": 0, "api_keys": [key], "engine": engine}
    with ExitStack() as stack:
        if tier:
            from kvmesh.kvstore.redis_process import RedisServer

            work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-robust-redis-"))
            redis = RedisServer(work).start()
            stack.callback(redis.stop)
            engine["lmcache"] = {"l1_size_gb": 0.2, "chunk_size": ENGINE_BLOCK, "l2": redis.url, "start_timeout_s": 300}
        t0 = time.perf_counter()
        url = start_local(config, num_cpus=max(os.cpu_count() or 2, replicas))
        stack.callback(stop_local)
        log(f"    {policy}{' with LMCache' if tier else ''}: {replicas} replicas up in {time.perf_counter() - t0:.0f}s")
        yield url, key


@contextmanager
def bare_servers(replicas: int, log=print) -> Iterator[tuple[list, Any, Path]]:
    """`replicas` bare vLLM servers with the kvmesh app's engine settings (tiny model, block size 32,
    context 4096), for a peer router in front; yields (servers, their EngineSpec, a work folder) and
    stops them on leaving."""
    from kvmesh.benchmarks.peers import engines
    from kvmesh.deployments.config import resolve_model

    spec = engines.EngineSpec(model=resolve_model("tiny"), block_size=ENGINE_BLOCK, max_model_len=4096)
    work = Path(tempfile.mkdtemp(prefix="kvmesh-robust-peer-"))
    t0 = time.perf_counter()
    try:
        servers = engines.start_servers(replicas, spec, work)
    except Exception:
        log(f"    the vLLM servers did not start; their logs: {work / 'logs'}")
        raise
    except BaseException:  # stopped (SIGTERM, Ctrl-C): no failure to read about
        shutil.rmtree(work, ignore_errors=True)
        raise
    keep = False  # the folder (the servers' logs) stays for a leg that failed; not for one that was stopped
    try:
        log(f"    {replicas} vLLM servers up in {time.perf_counter() - t0:.0f}s")
        yield servers, spec, work
    except Exception:
        keep = True
        raise
    finally:
        engines.stop_servers(servers)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def require_live_tools(tier: bool) -> None:
    """Raise, naming how to install it, when a program the live runs start is missing: the peer router
    (FileNotFoundError), and with `tier` redis-server, the shared tier behind LMCache (`RedisNotInstalled`)."""
    from kvmesh.benchmarks.peers import setups
    from kvmesh.kvstore.redis_process import redis_server_binary

    setups.router_binary(peer_setup(PEER).router)
    if tier:
        redis_server_binary()


def peer_setup(name: str):
    """The peer bench's setup called `name` (a router and its policy)."""
    from kvmesh.benchmarks.peers import setups

    return next(x for x in setups.PEER_SETUPS if x.name == name)


def peer_target(recs: list[dict], d: Draw, replicas: int, peer_hit: float | None, exact_s: float = 30.0) -> dict:
    """Can any placement reach the peer's hit rate less 0.03 while keeping prefill max/mean <= 1.25
    (`exact_placement.decide_target`, the untimed model `bounds_for` uses)? The peer reaches its hit rate by
    piling up, so where no balanced placement reaches it, the peer check's miss is the workload's
    arithmetic, not the policy's."""
    if peer_hit is None:  # the peer's run had no successful request: there is no hit rate to reach
        return {"hit": None, "verdict": "undecided", "placement": None}
    trace = engine_trace(recs, d.tokens_per_block, ENGINE_BLOCK)
    verdict, placement = _decided(trace, replicas, peer_hit - 0.03, exact_s)
    return {"hit": peer_hit - 0.03, "verdict": verdict, "placement": placement}


def run_live(recs: list[dict], d: Draw, replicas: int, policy: str, log=print, tier: bool = False) -> dict:
    """One fresh local app with `policy` (with LMCache tiers when `tier`: `live_app`), the replay, and the
    replay's per-replica figures."""
    from kvmesh.deployments.replay import replay

    with live_app(replicas, policy, log, tier) as (url, key):
        report = replay(recs, replay_config(url, d, api_key=key))
        state = router_state(url, key)
    s = report.summary()
    per = list(s["per_replica"].values()) + [{"requests": 0, "uncached_prompt_tokens": 0}] * (
        replicas - len(s["per_replica"])
    )
    sent = sorted(report.results, key=lambda r: r.start_s)
    return {
        **_figures(s, [p["requests"] for p in per], [p["uncached_prompt_tokens"] for p in per]),
        "placement": first_use_names([(r.index, r.replica) for r in sent if r.error is None], len(recs)),
        "decisions": by_record_index(
            list((state.get("router") or {}).get("recent_decisions") or []),
            {r.request_id: r.index for r in report.results if r.request_id},
        ),
        **({"router": accounting} if (accounting := router_accounting(state)) else {}),
    }


def router_state(url: str, key: str) -> dict:
    """The app's `/kvmesh/state` after a replay; {} when it cannot be read (the replay's figures stand
    without it)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/kvmesh/state", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r.raise_for_status()
        state = r.json()
    except (httpx.HTTPError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def router_accounting(state: dict) -> dict:
    """What a live run's router says of its own placements (from `router_state`): requests held for a prefix
    being stored in the tiers and how many of those holds ran out, and the cached prompt tokens it predicted
    against those the engines delivered (`deployments/prediction.py`). Why kept per run: a run below the
    infinite-cache bound then says whether the router placed for less (predicted = delivered), the engines
    delivered less than it placed for (a tier lookup that missed), or holds ran out (the wait outlasted
    its limit). {} when the state had none of it."""
    router, ledger = state.get("router") or {}, state.get("prediction") or {}
    out = {k: int(router[k]) for k in ("held_for_tier", "hold_timeouts") if k in router}
    out.update({k: int(ledger[k]) for k in ("predicted_tokens", "delivered_tokens", "mismatches") if k in ledger})
    return out


def by_record_index(decisions: list[dict], index_of: dict[str, int]) -> list[dict]:
    """The decisions of the replay's requests, keyed by record index instead of the server's request id
    (the simulator's key), in the order the router made them."""
    return [{**d, "request_id": index_of[d["request_id"]]} for d in decisions if d.get("request_id") in index_of]


def _figures(summary: dict, requests: list[int], prefill: list[float]) -> dict:
    """One live run's row: hit rate, errors, TTFT p50 from the replay summary; requests and prefill
    tokens per replica (sorted: replica names differ between runs) and prefill max/mean. A run none of whose
    requests succeeded has no hit rate, TTFT or prefill max/mean (None: the replay summary's own None, kept
    so that every check on it is missed)."""
    return {
        "hit": summary["hit_rate_tokens"],
        "errors": summary["errors"],
        "ttft_p50_s": summary["ttft_p50_s"],
        "requests": sorted(requests),
        "prefill": sorted(prefill),
        "prefill_max_over_mean": (max_over_mean(prefill) or 1.0) if sum(requests) else None,
    }


def run_peer_router(recs: list[dict], d: Draw, replicas: int, setup_name: str, log=print) -> dict:
    """The same replay through a peer router (vllm-router cache_aware by default) over `replicas` bare
    vLLM servers with the kvmesh app's engine settings (`bare_servers`): identical servers, so the hit
    rates compare. Per-worker figures come from the servers' /metrics."""
    from kvmesh.benchmarks.peers import engines
    from kvmesh.benchmarks.peers.run import replay_through_peer
    from kvmesh.deployments.replay import replay

    def send(url: str) -> dict:
        return replay(recs, replay_config(url, d, model=engines.SERVED_MODEL_NAME)).summary()

    log(f"    {setup_name}:")
    with bare_servers(replicas, log) as (servers, spec, work):
        summary, workers = replay_through_peer(peer_setup(setup_name), servers, spec, work / "logs", send)
    row = _figures(summary, [w["requests"] for w in workers], [w["prefill_tokens"] for w in workers])
    return {"setup": setup_name, **row}


def compare(live: dict, sim: dict) -> dict:
    """Sim-vs-live differences: hit rate, prefill max/mean, and per-replica request counts (sorted,
    as a share of the mean count: replica names differ between the two runs); and the share of requests
    the two placed on the same replica (`placed_alike`), where both runs recorded their placements; and the
    first request they placed differently (`first_divergence`, in the simulator's routing order), where
    both recorded their decisions. A difference with a figure missing on either side (a run none of whose
    requests succeeded) is None, which `within_tolerances` and `live_checks` judge as outside."""
    mean = sum(live["requests"]) / len(live["requests"]) if live["requests"] else 1.0
    counts = max(abs(a - b) for a, b in zip(live["requests"], sim["requests"])) / mean if mean else None
    out = {
        "hit": apart(live["hit"], sim["hit"]),
        "prefill_max_over_mean": apart(live["prefill_max_over_mean"], sim["prefill_max_over_mean"]),
        "requests": counts,
    }
    if live.get("placement") and sim.get("placement"):
        out["placed_alike"] = placed_alike(live["placement"], sim["placement"])
    if "decisions" in live and "decisions" in sim:
        order = [x["request_id"] for x in sim["decisions"]]
        out["first_divergence"] = first_divergence(live["decisions"], sim["decisions"], order)
    return out


def live_sweep(
    seeds: Sequence[int],
    log=print,
    tier: bool = False,
    family: str = "family",
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Per draw (of `family`, a key of `FAMILIES`): bounds, kvmesh, round robin and the peer router live, the
    simulator in the same send order; with `tier` also kvmesh and round robin with LMCache tiers (`live_app`:
    the deployed configuration, and the baseline on the same engines) and both simulated with a shared tier.
    `on_row` is given each draw's row as soon as it is complete. Why: a draw runs live for minutes, so a
    caller that saves each row there keeps the draws already run when a later one fails."""
    rows = []
    for seed in seeds:
        d = FAMILIES[family].draw(seed)
        recs = d.records()
        n = live_replicas(d)
        log(f"  draw {seed}: {len(recs)} requests, {n} replicas, concurrency {live_concurrency(d)}")
        row: dict[str, Any] = {
            "seed": seed,
            **({"family": family} if family != "family" else {}),
            "replicas": n,
            "requests": len(recs),
            "bounds": bounds_for(recs, d, n),
            "kvmesh": run_live(recs, d, n, "kvmesh", log),
            "round_robin": run_live(recs, d, n, "round_robin", log),
            "peer": run_peer_router(recs, d, n, PEER, log),
            "sim": simulate_in_send_order(recs, d, n, "kvmesh"),
            "sim_round_robin": simulate_in_send_order(recs, d, n, "round_robin"),
        }
        if tier:
            row["kvmesh_tier"] = run_live(recs, d, n, "kvmesh", log, tier=True)
            row["round_robin_tier"] = run_live(recs, d, n, "round_robin", log, tier=True)
            row["sim_tier"] = simulate_in_send_order(recs, d, n, "kvmesh", shared=True)
            row["sim_round_robin_tier"] = simulate_in_send_order(recs, d, n, "round_robin", shared=True)
        row["bounds"]["peer_target"] = peer_target(recs, d, n, row["peer"]["hit"])
        row["sim_vs_live"] = compare(row["kvmesh"], row["sim"])
        row["sim_spread"] = spread_match(row["kvmesh"], simulated_spread(recs, d, n))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# the live targets of the arm without a tier, as `live_checks` names them, besides the peer check
# (`peer_check`); the sim-vs-live and simulated TTFT checks are judged apart
NO_TIER_TARGETS = (
    "hit >= 0.95 x balance-bounded",
    "prefill max/mean <= 1.25",
    "TTFT p50 <= round robin's",
    "zero errors",
)


def peer_check(setup: str) -> str:
    """The name of the live check against the peer router `setup`."""
    return f"hit >= {setup} - 0.03"


def live_checks(row: dict) -> dict[str, bool]:
    """The live targets for one draw. A check on a missing figure (None: a run, kvmesh's or a baseline's, none
    of whose requests succeeded) is missed (`at_most`)."""
    k, rr, b = row["kvmesh"], row["round_robin"], row["bounds"]
    balance, max_over_mean, ttft, errors = NO_TIER_TARGETS
    diff = row["sim_vs_live"]
    checks = {
        balance: at_most(0.95 * b["balance"], k["hit"]),
        max_over_mean: at_most(k["prefill_max_over_mean"], 1.25),
        ttft: at_most(k["ttft_p50_s"], rr["ttft_p50_s"]),
        errors: k["errors"] == 0,
        "sim hit within 0.02": at_most(diff["hit"], SIM_TOLERANCES["hit"]),
        "sim max/mean within 0.15": at_most(diff["prefill_max_over_mean"], SIM_TOLERANCES["prefill_max_over_mean"]),
        "sim requests/replica within 0.15": at_most(diff["requests"], SIM_TOLERANCES["requests"]),
        # a baseline's figures come from its requests that succeeded: one that failed some is no comparison
        "round robin zero errors": rr.get("errors", 0) == 0,
    }
    if "peer" in row:  # rows saved before the peer leg was added have none
        peer_hit = row["peer"]["hit"]
        checks[peer_check(row["peer"]["setup"])] = peer_hit is not None and at_most(peer_hit - 0.03, k["hit"])
        checks["peer zero errors"] = row["peer"].get("errors", 0) == 0
    if "sim_round_robin" in row:  # nor the simulated round robin
        checks["simulated TTFT p50 <= round robin's"] = at_most(
            row["sim"]["ttft_p50_s"], row["sim_round_robin"]["ttft_p50_s"]
        )
    if "round_robin_tier" in row:  # the deployed configuration, against round robin on the same LMCache engines
        t, rt = row["kvmesh_tier"], row["round_robin_tier"]
        checks["with LMCache: hit >= 0.95 x balance-bounded"] = at_most(0.95 * b["balance"], t["hit"])
        checks["with LMCache: prefill max/mean <= 1.25"] = at_most(t["prefill_max_over_mean"], 1.25)
        checks["with LMCache: TTFT p50 <= round robin's with LMCache"] = at_most(t["ttft_p50_s"], rt["ttft_p50_s"])
        checks["with LMCache: zero errors"] = t["errors"] == 0
        checks["with LMCache: round robin zero errors"] = rt.get("errors", 0) == 0
    if "sim_round_robin_tier" in row:  # nor round robin simulated with the shared tier
        checks["simulated with a shared tier: TTFT p50 <= round robin's"] = at_most(
            row["sim_tier"]["ttft_p50_s"], row["sim_round_robin_tier"]["ttft_p50_s"]
        )
    return checks


def meets_no_tier_targets(row: dict, checks: dict[str, bool]) -> bool:
    """Did the arm without a tier meet every live target (`NO_TIER_TARGETS`, and the peer check where the row
    has a peer leg)? `checks`: `live_checks(row)`."""
    names = [*NO_TIER_TARGETS, *([peer_check(row["peer"]["setup"])] if "peer" in row else [])]
    return all(checks[name] for name in names)


def format_live(rows: Sequence[dict]) -> str:
    """The live rows as a table, and per draw the lines under it; a missing figure (a run none of whose
    requests succeeded) prints as "-"."""
    f = fmt_figure
    lines = [
        "seed  N  reqs  bound inf/bal   kvmesh hit  max/mean  p50 ms | rr hit  max/mean  p50 ms | "
        "peer hit  max/mean  p50 ms | sim hit  max/mean  req/replica live vs sim  (placed alike)"
    ]
    for r in rows:
        k, rr, s, b = r["kvmesh"], r["round_robin"], r["sim"], r["bounds"]
        pe = r.get("peer")
        peer = (
            f"{f(pe['hit'], '5.3f')}     {f(pe['prefill_max_over_mean'], '4.2f')}      "
            f"{f(pe['ttft_p50_s'], '5.0f', 1e3)}"
            if pe
            else f"{'-':>5}     {'-':>4}      {'-':>5}"
        )
        lines.append(
            f"{r['seed']}  {r['replicas']}  {r['requests']:4d}  {b['infinite']:.3f}/{b['balance']:.3f}  "
            f"  {f(k['hit'], '5.3f')}       {f(k['prefill_max_over_mean'], '4.2f')}      "
            f"{f(k['ttft_p50_s'], '5.0f', 1e3)} | "
            f"{f(rr['hit'], '5.3f')}   {f(rr['prefill_max_over_mean'], '4.2f')}      "
            f"{f(rr['ttft_p50_s'], '5.0f', 1e3)} | "
            f"{peer} | "
            f"{f(s['hit'], '5.3f')}    {f(s['prefill_max_over_mean'], '4.2f')}      {k['requests']} vs {s['requests']}"
            + (f"  ({alike:.0%})" if (alike := r["sim_vs_live"].get("placed_alike")) is not None else "")
        )
    for r in rows:
        b = r["bounds"]
        if "target_verdict" in b:  # rows saved before the solver was added have none
            at = _found_at(b["target_placement"])
            lines.append(f"  {r['seed']}: the live target is {b['target_verdict']}{at}")
        if (pt := b.get("peer_target")) is not None:  # rows saved before it was added have none
            at = _found_at(pt["placement"])
            lines.append(
                f"  {r['seed']}: the peer's hit less 0.03 ({f(pt['hit'], '.3f')}) within max/mean 1.25 is "
                f"{pt['verdict']}{at}"
            )
    for r in rows:
        if "kvmesh_tier" in r:
            t, st, inf = r["kvmesh_tier"], r["sim_tier"], r["bounds"]["infinite"]
            lines.append(
                f"  {r['seed']}: kvmesh with LMCache (host tier shared on the node, Redis behind it): "
                f"hit {f(t['hit'], '.3f')} ({f(t['hit'] / inf if t['hit'] is not None else None, '.3f')} of the "
                f"infinite-cache bound), prefill max/mean {f(t['prefill_max_over_mean'], '.2f')}, "
                f"TTFT p50 {f(t['ttft_p50_s'], '.0f', 1e3)} ms, {t['errors']} errors; simulated with a shared tier: "
                f"hit {f(st['hit'], '.3f')}, max/mean {f(st['prefill_max_over_mean'], '.2f')}"
                + (f"; {format_accounting(acc)}" if (acc := t.get("router")) else "")
            )
            if (rt := r.get("round_robin_tier")) is not None:  # rows saved before it was added have none
                lines.append(
                    f"  {r['seed']}: round robin with LMCache: hit {f(rt['hit'], '.3f')}, prefill max/mean "
                    f"{f(rt['prefill_max_over_mean'], '.2f')}, TTFT p50 {f(rt['ttft_p50_s'], '.0f', 1e3)} ms, "
                    f"{rt['errors']} errors"
                )
    for r in rows:
        if (sp := r.get("sim_spread")) is not None:  # rows saved before it was added have none
            lines.append(
                f"  {r['seed']}: live within every tolerance of {sp['within']}/{sp['runs']} simulated runs with "
                f"sends jittered (hit {sp['hit'][0]:.3f}-{sp['hit'][1]:.3f}, max/mean "
                f"{sp['prefill_max_over_mean'][0]:.2f}-{sp['prefill_max_over_mean'][1]:.2f})"
            )
    for r in rows:
        if (div := r["sim_vs_live"].get("first_divergence")) is not None:
            lines += format_divergence(div, head=f"  {r['seed']}: ")
    for r in rows:
        if "sim_round_robin" in r:
            lines.append(
                f"  {r['seed']}: simulated TTFT p50 (one accelerator per replica) kvmesh "
                f"{f(r['sim']['ttft_p50_s'], '.1f', 1e3)} ms, round robin "
                f"{f(r['sim_round_robin']['ttft_p50_s'], '.1f', 1e3)} ms"
                + (
                    f"; with a shared tier kvmesh {f(r['sim_tier']['ttft_p50_s'], '.1f', 1e3)} ms, round robin "
                    f"{f(rt['ttft_p50_s'], '.1f', 1e3)} ms"
                    if (rt := r.get("sim_round_robin_tier")) is not None
                    else ""
                )
            )
    return "\n".join(lines)


def format_accounting(acc: dict) -> str:
    """`router_accounting`'s figures in a line (rows saved before it was kept have none)."""
    parts = []
    if "held_for_tier" in acc:
        parts.append(f"{acc['held_for_tier']} held for the tier, {acc.get('hold_timeouts', 0)} ran out")
    if "predicted_tokens" in acc:
        parts.append(
            f"cached tokens predicted {acc['predicted_tokens']}, delivered {acc.get('delivered_tokens', 0)} "
            f"({acc.get('mismatches', 0)} requests differ)"
        )
    return "router: " + ", ".join(parts)


def _found_at(placement: list[float] | None) -> str:
    """The placement the solver found, as `format_live` prints it after a verdict ("" when none)."""
    return f": a placement found offline reaches {placement[0]:.3f} at max/mean {placement[1]:.2f}" if placement else ""

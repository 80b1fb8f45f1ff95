"""`kvmesh demo` (`make demo`): the embedded default, end to end on one machine.

Builds the tiny local model and, for each run in `--policies` (default kvmesh, round robin, and
kvmesh with the LMCache tiers), serves N engine replicas behind the router, replays a slice of the
bundled Mooncake conversation trace (whole multi-turn conversations, scaled to the tiny model's
context) and shuts down; then prints the runs side by side with the infinite-cache bound and, as a
reference (not a bound), round robin over infinite caches in record order.

Fairness: each policy gets a freshly started app (cold engine caches, empty router index), the same
requests in the same order, the same client concurrency and the same token expansion.

`--simulate` runs the same slice through the trace simulator instead (no engines; for machines
without vLLM), and so does the demo when the live stack cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from kvmesh.cluster.whole_file import atomic_write
from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import int_up_to, output_file, positive_int
from kvmesh.deployments.cli.simulate import MAX_SIM_REPLICAS
from kvmesh.deployments.config import MAX_REPLICAS

# Live by default: real engines behind Ray Serve (deployments/app.py). `--simulate` is for machines
# without vLLM.
LIVE_BY_DEFAULT = True
TIERS_SUFFIX = "+tiers"
ENGINE_BLOCK = 32  # tokens per KV block of the CPU engines the live demo serves
MAX_MODEL_LEN = 2048  # the tiny model's serving context (deployments/config.py default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=int_up_to(MAX_SIM_REPLICAS),
        default=2,
        help=f"engine replicas (default 2, <= {MAX_SIM_REPLICAS:,})",
    )
    parser.add_argument("--conversations", type=positive_int, default=16, help="conversations taken from the trace")
    parser.add_argument("--tokens-per-block", type=positive_int, default=32, help="tokens per 512-token trace block")
    parser.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    parser.add_argument("--max-tokens", type=positive_int, default=8, help="output tokens per request (cap)")
    parser.add_argument(
        "--policies",
        default="kvmesh,round_robin,kvmesh+tiers",
        help="comma-separated, run in this order; NAME+tiers = that policy with the node's LMCache "
        "host tier and an fs shared tier behind the engines",
    )
    parser.add_argument("--model", default="tiny", help="'tiny' (built locally) or a HF model directory")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--live",
        dest="live",
        action="store_true",
        default=LIVE_BY_DEFAULT,
        help="real engines behind Ray Serve" + (" (default)" if LIVE_BY_DEFAULT else ""),
    )
    mode.add_argument(
        "--simulate",
        dest="live",
        action="store_false",
        help="the trace simulator instead of live engines" + ("" if LIVE_BY_DEFAULT else " (default)"),
    )
    parser.add_argument(
        "--tiers",
        action="store_true",
        help="run every policy with tiers, as NAME+tiers: live, each node gets an LMCache server (host tier + "
        "fs shared tier); simulated, a node-wide host tier and a shared tier; hits reported by tier",
    )
    parser.add_argument("--json", default=None, type=output_file, help="write all results here")


def _check(args) -> list[str]:
    if args.model != "tiny" and not os.path.isdir(args.model):  # before Ray starts, not as its deploy failing
        raise CliError(f"kvmesh demo: --model {args.model}: not a local model directory (or 'tiny')")
    if args.tokens_per_block % ENGINE_BLOCK:
        raise CliError(
            f"kvmesh demo: --tokens-per-block must be a multiple of {ENGINE_BLOCK} (the CPU engine block size)"
        )
    if args.live and args.replicas > MAX_REPLICAS:  # the app's own limit, here before any work
        raise CliError(
            f"kvmesh demo: --replicas must be <= {MAX_REPLICAS:,} for a live run "
            f"(<= {MAX_SIM_REPLICAS:,} with --simulate)"
        )
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    from kvmesh.policies.registry import POLICY_NAMES

    unknown = [p for p in names if _policy(p) not in POLICY_NAMES]
    if not names or unknown:
        raise CliError(
            f"kvmesh demo: unknown policy {', '.join(unknown) or '(none)'}; known: {', '.join(POLICY_NAMES)}"
        )
    if args.tiers:  # every run has tiers: each is headed as such (once, where two names become one)
        names = list(dict.fromkeys(_tiered(n) for n in names))
    return names


def _tiered(name: str) -> str:
    return name if name.endswith(TIERS_SUFFIX) else name + TIERS_SUFFIX


def _policy(name: str) -> str:
    """The placement policy of a demo run name (`kvmesh+tiers` runs the kvmesh policy with tiers)."""
    return name.removesuffix(TIERS_SUFFIX)


def _with_tiers(args, name: str) -> bool:
    return bool(getattr(args, "tiers", False)) or name.endswith(TIERS_SUFFIX)


def workload(args) -> list[dict]:
    """The demo's requests: whole conversations from the bundled trace that fit the model context."""
    from kvmesh.cluster.trace import read_records
    from kvmesh.cluster.workloads import conversation_slice

    records = read_records("conversation")
    return conversation_slice(
        records,
        args.conversations,
        min_turns=3,
        tokens_per_block=args.tokens_per_block,
        max_prompt_tokens=MAX_MODEL_LEN - args.max_tokens - 8,
    )


def run(args: argparse.Namespace) -> int:
    from kvmesh.cluster.bounds import record_bounds

    names = _check(args)
    records = workload(args)
    if not records:  # nothing to serve or simulate, and no bound of nothing
        raise CliError(
            f"kvmesh demo: no conversation of the trace fits the {MAX_MODEL_LEN}-token context with "
            f"--max-tokens {args.max_tokens} and --tokens-per-block {args.tokens_per_block}: lower them"
        )
    bounds = record_bounds(records, args.tokens_per_block, ENGINE_BLOCK, replicas=args.replicas)
    print(
        f"workload: {len(records)} requests from {_conversations(args, records)} of the Mooncake "
        f"conversation trace, {bounds['prompt_tokens']:,} prompt tokens ({args.tokens_per_block} tokens/block)"
    )
    live = args.live
    if live:
        try:
            import kvmesh.deployments.app  # noqa: F401  (the live stack: Ray Serve + vLLM)
        except ImportError as exc:
            print(f"live serving unavailable ({exc}); running the simulator instead", file=sys.stderr)
            live = False
    replays: dict = {}  # run name -> ReplayReport (live runs), for the cachetest report
    explained: dict = {}  # run name -> request id -> the router's record of it, for the same report
    results = _run_live(args, names, records, replays, explained) if live else _run_simulated(args, names, records)
    _report(args, names, results, bounds, live, replays)
    if replays:
        print(f"cachetest report: {_cachetest_report(args, records, replays, results, explained)}")
    if args.json:
        with atomic_write(args.json) as fh:  # whole or not at all: makes its folder
            json.dump({"mode": "live" if live else "simulated", "bounds": bounds, "results": results}, fh, indent=2)
    return 0 if all(r.get("errors", 0) == 0 for r in results.values()) else 1


def _conversations(args, records: list[dict]) -> str:
    """The conversations the workload took, and how many were asked for where the trace had fewer that fit."""
    chosen = len({r.get("user") for r in records})
    asked = "" if chosen == args.conversations else f" (asked for {args.conversations:,}: no more of the trace fit)"
    return f"{chosen:,} conversations{asked}"


def _cachetest_report(
    args, records: list[dict], replays: dict, results: dict[str, dict], explained: dict[str, dict]
) -> str:
    """This run as a `kvmesh cachetest` report (hit rates, costs, misses by reason, per policy)."""
    from kvmesh.cluster.cachetest_html import write_outputs
    from kvmesh.deployments.cachetest import report_from_replays

    counters = {name: r.get("server", {}).get("counters") or {} for name, r in results.items()}
    report = report_from_replays(
        records, replays, args.tokens_per_block, ENGINE_BLOCK, counters=counters, explained=explained
    )
    out = os.path.join(os.path.dirname(args.json) if args.json else "out", "demo-cachetest")
    return str(write_outputs(report, out)["html"])


def _run_live(
    args, names: list[str], records: list[dict], replays: dict | None = None, explained: dict | None = None
) -> dict[str, dict]:
    from kvmesh.deployments.app import start_local, stop_local
    from kvmesh.deployments.cachetest import STATS_SETTLE_S
    from kvmesh.deployments.cli.serve import start_failure
    from kvmesh.deployments.process_tree import become_subreaper
    from kvmesh.deployments.replay import ReplayConfig, ReplayError, replay

    # as `kvmesh serve`'s driver: what Ray's processes orphan (an agent whose raylet ended first) is reparented
    # here, not to init, so each run's stop_local ends it before the next run starts
    become_subreaper()
    key = "kvm-demo-" + os.urandom(6).hex()
    results = {}
    for name in names:
        engine = {"model": args.model}
        l2_dir = None
        if _with_tiers(args, name):  # a fresh shared-tier folder per run: an L2 kept from the previous run is not cold
            l2_dir = tempfile.mkdtemp(prefix=f"kvmesh-demo-l2-{name}-")
            engine["lmcache"] = {"l1_size_gb": 1, "l2": "fs", "l2_path": l2_dir}
        config = {"replicas": args.replicas, "policy": _policy(name), "port": 0, "api_keys": [key], "engine": engine}
        t0 = time.perf_counter()
        print(f"[{name}] starting {args.replicas} replicas ...", flush=True)
        try:
            try:
                url = start_local(config)
            except Exception as exc:  # one line, as `kvmesh serve` says it; start_local left nothing running
                raise CliError(f"kvmesh demo: {name}: could not start the app: {start_failure(exc)}") from None
            print(f"[{name}] serving at {url} after {time.perf_counter() - t0:.0f}s; replaying", flush=True)
            cfg = ReplayConfig(
                url=url,
                tokens_per_block=args.tokens_per_block,
                concurrency=args.concurrency,
                api_key=key,
                max_tokens=args.max_tokens,
                timeout_s=120,
                max_errors=10,
            )
            rep = replay(records, cfg)
            if replays is not None:
                replays[name] = rep
            # the fleet is known: a replica that answered nothing counts in the balance figure
            results[name] = rep.to_json(per_request=bool(args.json), replicas=args.replicas)
            time.sleep(STATS_SETTLE_S)  # the engines' last LMCache loads reach the routers with their stats
            results[name]["server"] = _server_state(url, key)
            if explained is not None:  # the router's record of each request, for the cachetest report's misses
                explained[name] = _explanations(url, key, rep)
        except ReplayError as exc:
            raise CliError(f"kvmesh demo: {exc}") from None
        except TimeoutError as exc:  # a wait after the start that ran out
            raise CliError(f"kvmesh demo: {name}: {exc}") from None
        finally:
            stop_local()
            if l2_dir:
                shutil.rmtree(l2_dir, ignore_errors=True)
    return results


def _explanations(url: str, key: str, rep) -> dict[str, dict]:
    """`/kvmesh/explain` of every request of the run, by request id."""
    from kvmesh.deployments.cachetest import CachetestConfig, fetch_explanations

    ids = [r.request_id for r in rep.results if r.request_id]
    try:
        return fetch_explanations(CachetestConfig(url=url, api_key=key), ids)
    except Exception as exc:  # the report then says `unknown` for what these would have split
        print(f"GET /kvmesh/explain failed: {exc}", file=sys.stderr)
        return {}


def _server_state(url: str, key: str) -> dict:
    """What the server says about the run: predicted vs delivered cached tokens, hits by tier."""
    import httpx

    try:
        state = httpx.get(url + "/kvmesh/state", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"GET /kvmesh/state failed: {exc}"}
    from kvmesh.deployments.cachetest import counters_from_state

    pred = state.get("prediction") or {}
    return {
        "counters": counters_from_state(state),
        "prediction": {
            k: pred.get(k) for k in ("compared", "mismatches", "alarm", "predicted_tokens", "delivered_tokens")
        },
        "tiers": state.get("tiers"),
    }


def _run_simulated(args, names: list[str], records: list[dict]) -> dict[str, dict]:
    """The same requests through the trace simulator (cluster/simulator.py), at the live engines' block size;
    a `+tiers` run's tiers store and load whole chunks of the LMCache chunk size the live run uses."""
    from kvmesh.cluster.simulator import SimConfig, simulate
    from kvmesh.cluster.workloads import engine_trace
    from kvmesh.kvstore.tiers import TierConfig
    from kvmesh.policies.registry import make_policy

    trace = engine_trace(records, args.tokens_per_block, ENGINE_BLOCK, name="demo-conversations")
    reqs = trace.requests
    runs = {}  # one simulation per tier set-up; a `+tiers` run gets a node-wide host tier and a shared tier
    plain = [n for n in names if not _with_tiers(args, n)]
    tiered = [n for n in names if _with_tiers(args, n)]
    for group, cfg in (
        (plain, SimConfig(args.replicas, capacity_blocks=100_000)),
        (
            tiered,
            SimConfig(
                args.replicas,
                capacity_blocks=100_000,
                host_blocks=100_000,
                replicas_per_node=args.replicas,
                shared=True,
                tier_chunk_blocks=TierConfig().chunk_size // ENGINE_BLOCK,
            ),
        ),
    ):
        if group:
            doc = simulate(trace, cfg, {n: make_policy(_policy(n)) for n in group})
            runs.update({n: doc["policies"][n] for n in group})
    out = {}
    for name in names:
        p = runs[name]
        per_replica = {
            rid: {
                "requests": row["requests"],
                "prompt_tokens": row["prompt_tokens"],
                "cached_tokens": row["prompt_tokens"] - row["prefill_tokens"],
                "uncached_prompt_tokens": row["prefill_tokens"],
                "hit_rate_tokens": row["hit_rate_tokens"],
            }
            for rid, row in p["per_replica"].items()
        }
        out[name] = {
            "requests": len(reqs),
            "errors": 0,
            "hit_rate_tokens": p["hit_rate_tokens"],
            "hit_rate_requests": p["hit_rate_requests"],
            "prompt_tokens": p["prompt_tokens"],
            "cached_tokens": p["cached_tokens"],
            "uncached_prompt_tokens": p["prompt_tokens"] - p["cached_tokens"],
            "ttft_p50_s": p["ttft_p50_s"],
            "ttft_p90_s": p["ttft_p90_s"],
            "throughput_tokens_s": p["throughput_tokens_s"],
            "uncached_max_over_mean": p["imbalance"],
            "per_replica_known": True,
            "per_replica": per_replica,
            "hit_tokens_by_tier": p["hit_tokens_by_tier"] if _with_tiers(args, name) else None,
        }
    return out


def _report(args, names, results, bounds, live: bool, replays: dict | None = None) -> None:
    """The text report. `replays` (run name -> ReplayReport) pairs the runs request by request; without
    it the runs' `per_request` rows do, if they were kept."""
    from kvmesh.deployments.replay import format_table

    print()
    print(
        ("live: real vLLM engines behind Ray Serve" if live else "simulated (trace simulator)")
        + f", {args.replicas} replicas, cold start per policy"
    )
    print(format_table(results))
    # the round-robin figure sends request i to cache i mod N in record order; a live round robin sends in an
    # order of its own (the replies' order, at the client's concurrency), so it can land above or below it
    print(f"{'bound':28}infinite cache {100 * bounds['infinite']['hit_rate']:.1f}% (over every arrival order)")
    print(
        f"{'reference, not a bound':28}round robin over {args.replicas} infinite caches in record order "
        f"{100 * bounds['round_robin_infinite']['hit_rate']:.1f}%"
    )
    for name, r in results.items():
        errors = int(r.get("errors") or 0)
        if errors:  # the run's figures are over its answered requests only, so not comparable with the bounds
            print(
                f"{name}: {errors} of {r.get('requests', 0)} requests failed: its figures are partial "
                "(over the answered requests only) and not compared with the bounds"
            )
        elif (r.get("hit_rate_tokens") or 0) > bounds["infinite"]["hit_rate"] + 0.01:
            print(f"WARNING: {name} hit more than an infinite cache could: cache state leaked from an earlier run")
        server = r.get("server") or {}
        pred, tiers = server.get("prediction") or {}, server.get("tiers")
        if pred.get("compared"):  # deployments/prediction.py: a mismatch is a difference of a block or more
            print(
                f"{name}: router predicted {pred['predicted_tokens']:,} cached tokens, engines delivered "
                f"{pred['delivered_tokens']:,}; {pred['mismatches']} of {pred['compared']} requests differ "
                f"by a block ({ENGINE_BLOCK} tokens) or more"
            )
        cached = int(r.get("cached_tokens") or 0)
        by_tier = r.get("hit_tokens_by_tier")  # simulated runs know the exact split
        if by_tier:
            print(f"{name}: hits by tier: " + ", ".join(f"{t} {int(v):,} tokens" for t, v in by_tier.items()))
        elif tiers:  # LMCache counts its lookups node-wide over whole prompts, so they overlap engine-cache hits
            loaded = (server.get("counters") or {}).get("external_hit_tokens")
            split = (
                f"hbm {cached - min(cached, int(loaded)):,}, loaded through LMCache {min(cached, int(loaded)):,}"
                if loaded is not None
                else "hbm + LMCache"
            )
            print(
                f"{name}: hits by tier: {cached:,} cached tokens ({split}); LMCache lookups "
                f"found host {int(tiers.get('host_hit_tokens') or 0):,} and shared "
                f"{int(tiers.get('shared_hit_tokens') or 0):,} tokens"
            )
        elif _with_tiers(args, name):  # it had tiers, but the server's state did not say what they found
            why = server.get("error") or "the server's state has no tier report"
            print(f"{name}: hits by tier: {cached:,} cached tokens; split by tier unknown (state unavailable: {why})")
        else:
            print(f"{name}: hits by tier: hbm {cached:,} tokens (no host/shared tier in this run)")
    for a, b in (("kvmesh", "round_robin"), (_tiered("kvmesh"), _tiered("round_robin"))):
        if a in results and b in results:  # like with like: the same tier set-up
            _compare(results, replays, a, b)


def _rows(name: str, results: dict[str, dict], replays: dict | None) -> list[dict] | None:
    """Run `name`'s requests (index, error, prompt/cached tokens, TTFT), or None where not kept."""
    rep = (replays or {}).get(name)
    if rep is not None:
        return [vars(x) for x in rep.results]
    return results[name].get("per_request")


def _paired(a_rows: list[dict], b_rows: list[dict]) -> dict:
    """Two runs of the same requests over the requests answered in both (by request index), paired as the
    cachetest report pairs its passes (`cachetest_report.answered_in_both`, `ttft_p50s`)."""
    from kvmesh.cluster.cachetest_report import answered_in_both, ttft_p50s

    both = answered_in_both({x["index"]: x for x in a_rows}, {x["index"]: x for x in b_rows})
    counted = [(x, y) for x, y in both if x.get("cached_tokens") is not None and y.get("cached_tokens") is not None]
    return {
        "answered": len(both),
        "uncached": (
            sum(x["prompt_tokens"] - x["cached_tokens"] for x, _ in counted),
            sum(y["prompt_tokens"] - y["cached_tokens"] for _, y in counted),
            len(counted),
        ),
        "ttft_p50": ttft_p50s(both),
    }


def _compare(
    results: dict[str, dict], replays: dict | None, name_a: str = "kvmesh", name_b: str = "round_robin"
) -> None:
    """Run `name_a` (kvmesh) against `name_b` (round robin) over the same requests: those answered in both."""
    a, b = results[name_a], results[name_b]
    rr = name_b.replace("round_robin", "round robin")
    rows_a, rows_b = _rows(name_a, results, replays), _rows(name_b, results, replays)
    if rows_a is not None and rows_b is not None:
        p = _paired(rows_a, rows_b)
        uncached, ttft = p["uncached"], p["ttft_p50"]
    elif not a.get("errors") and not b.get("errors") and a.get("requests") == b.get("requests"):
        n = int(a.get("requests") or 0)  # every request answered in both: the runs' own figures are over the same set
        uncached = (a.get("uncached_prompt_tokens"), b.get("uncached_prompt_tokens"), n)
        ttft = (a.get("ttft_p50_s"), b.get("ttft_p50_s"), n)
    else:
        print(f"{name_a} vs {rr}: not compared (requests failed, and no per-request results to pair the runs)")
        return
    if uncached[0] is not None and uncached[1]:
        print(
            f"{name_a} computes {uncached[0] / uncached[1]:.2f}x the prompt tokens {rr} computes, "
            f"over {uncached[2]:,} requests answered in both"
        )
    if ttft[0] and ttft[1]:
        print(f"{name_a} p50 TTFT is {ttft[0] / ttft[1]:.2f}x {rr}'s, over {ttft[2]:,} requests answered in both")

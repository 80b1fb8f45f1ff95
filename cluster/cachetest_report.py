"""`kvmesh cachetest`'s figures: every pass's hit rates, TTFT, cost and misses by reason, from what was sent
(`cluster/cachetest_analysis.Sent`), as the `report.json` document (schema in docs/cachetest.md).

Pure: no network, no plotting (`cluster/cachetest_html.py` draws the plots and the page), so a report for
a log of tens of thousands of requests is built in seconds (benchmarks/bench_cachetest.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.cluster.cachetest_analysis import MissAnalyzer, Sent, paused_gc
from kvmesh.cluster.miss_reasons import REASONS
from kvmesh.cluster.stats import nearest_rank

SCHEMA_VERSION = 1


@dataclass
class PassRun:
    """One pass as the runner measured it."""

    name: str
    sent: list[Sent]
    wall_s: float
    concurrency: int
    output_tokens: int = 0
    counters_before: dict = field(default_factory=dict)  # server counters (evictions, tier hits, spills)
    counters_after: dict = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # logged id -> greedy output text
    fresh_fleet: bool = False  # sent to a newly started server: nothing computed before counts
    replicas: int | None = None  # engine replicas of the app that served it (`--serve`), else not known


@dataclass
class Rates:
    uncached_per_m: float = 3.00  # $ per 1M uncached input tokens
    cached_per_m: float = 0.30  # $ per 1M cached input tokens

    def cost(self, prompt: int, cached: int) -> float:
        return ((prompt - cached) * self.uncached_per_m + cached * self.cached_per_m) / 1e6


def _pct(values: list[float], q: float) -> float | None:
    return nearest_rank(values, q) if values else None


def _diff(before: dict, after: dict, key: str) -> int:
    """A counter's growth over the pass (tokens, chunks or evictions: whole numbers)."""
    return round(float(after.get(key) or 0) - float(before.get(key) or 0))


def _same_router(before: dict, after: dict) -> bool:
    """Did both reads of the router's counters reach the same router? Each ingress replica's router keeps its
    own index and eviction count (and a restarted one starts again at 0): a difference across two is no
    figure of the pass."""
    return before.get("router_instance") == after.get("router_instance")


def pass_figures(run: PassRun, reasons: Sequence[dict[str, int]], rates: Rates) -> dict:
    """The per-pass figures under the issue's keys (plus a few extras: wall, throughput, baselines)."""
    ok = [(s, r) for s, r in zip(run.sent, reasons) if s.error is None]
    known = [(s, r) for s, r in ok if s.cached_tokens is not None]
    prompt = sum(s.prompt_tokens for s, _ in ok)
    counted = sum(s.prompt_tokens for s, _ in known)  # the hit rate's own: requests whose cached tokens came back
    cached = sum(s.cached_tokens or 0 for s, _ in known)
    ttfts = sorted(s.ready_s - s.start_s for s, _ in ok if s.ready_s is not None)
    miss: dict[str, int] = {}
    for _, r in known:
        for k, v in r.items():
            miss[k] = miss.get(k, 0) + v
    # an interaction is (tenant, interaction id): two tenants' "conv0" are two interactions; only a completed
    # one's requests are in the cost per interaction (a failed interaction's answered turns would inflate it)
    interactions: dict[tuple, bool] = {}
    interaction_cost: dict[tuple, float] = {}
    for s in run.sent:
        key = (s.prepared.req.tenant, s.prepared.req.interaction)
        interactions[key] = interactions.get(key, True) and s.error is None
        if s.error is None:
            interaction_cost[key] = interaction_cost.get(key, 0.0) + rates.cost(s.prompt_tokens, s.cached_tokens or 0)
    completed = sum(interactions.values())
    completed_cost = sum(c for k, c in interaction_cost.items() if interactions[k])
    cost = rates.cost(prompt, cached)
    before, after = run.counters_before, run.counters_after
    server = bool(after)
    host = _diff(before, after, "host_hit_tokens") if server else 0
    shared = _diff(before, after, "shared_hit_tokens") if server else 0
    loaded = min(cached, host + shared)
    if "external_hit_tokens" in after:
        # LMCache's lookups count tokens the engine also held; what the engines loaded through it is the
        # part of the hits that came from the tiers. Tokens only the shared tier held were not in the
        # engine's cache either (what it computes goes to its node's host tier too): loaded from there
        loaded = min(cached, max(0, _diff(before, after, "external_hit_tokens")))
        shared = min(loaded, shared)
        host = loaded - shared
    # a row per tenant (replica) over every request sent, failed ones too (a tenant whose requests all
    # failed must show, not vanish); the token figures are over the answers with a cached-token count
    tenants: dict[str, dict] = {}
    replicas: dict[str, dict] = {}
    for s, r in zip(run.sent, reasons):
        for table, row_key in ((tenants, s.prepared.tok.tenant or ""), (replicas, s.replica)):
            row = table.setdefault(
                row_key, {"requests": 0, "errors": 0, "prompt_tokens": 0, "cached_tokens": 0, "miss_tokens": {}}
            )
            row["requests"] += 1
            if s.error is not None:
                row["errors"] += 1
                continue
            if s.cached_tokens is None:
                continue
            row["prompt_tokens"] += s.prompt_tokens
            row["cached_tokens"] += s.cached_tokens
            for k, v in r.items():
                row["miss_tokens"][k] = row["miss_tokens"].get(k, 0) + v
    for table in (tenants, replicas):
        for row in table.values():
            row["hit_rate_tokens"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else None
    return {
        "requests": len(run.sent),
        "errors": len(run.sent) - len(ok),
        "error_samples": sorted({s.error for s in run.sent if s.error})[:5],
        "prompt_tokens": prompt,
        # the hit rate's denominator: answers without a cached-token count are in prompt_tokens (they are
        # billed) but not here, and the miss reasons sum to counted - cached
        "counted_prompt_tokens": counted,
        "counted_requests": len(known),  # answers that reported their cached tokens
        "cached_tokens": cached,
        # None, not 0, when no answer reported its cached tokens: nothing was measured
        "hit_rate_tokens": cached / counted if counted else None,
        "hit_rate_requests": statistics.fmean(
            (s.cached_tokens or 0) / s.prompt_tokens if s.prompt_tokens else 0.0 for s, _ in known
        )
        if known
        else None,
        "requests_with_hit": statistics.fmean((s.cached_tokens or 0) > 0 for s, _ in known) if known else None,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "billed_input_tokens": prompt,
        "input_cost": cost,
        "input_cost_without_cache": rates.cost(prompt, 0),
        "completed_interactions": completed,
        "cost_per_interaction": completed_cost / completed if completed else None,
        "hits_by_tier": {"hbm": cached - loaded, "host": min(host, cached), "shared": max(0, loaded - host)}
        if server
        else {"hbm": None, "host": None, "shared": None, "unknown": cached},
        "evictions": _diff(before, after, "evictions") if server and _same_router(before, after) else None,
        "spills": {
            "to_host_chunks": _diff(before, after, "chunks_to_host"),
            "to_shared_chunks": _diff(before, after, "chunks_to_shared"),
        }
        if server
        else None,
        "miss_tokens": dict(sorted(miss.items(), key=lambda kv: REASONS.index(kv[0]))),
        "throughput_tokens_s": (prompt + run.output_tokens) / run.wall_s if run.wall_s > 0 else None,
        "throughput_requests_s": len(ok) / run.wall_s if run.wall_s > 0 else None,
        "wall_s": run.wall_s,
        "concurrency": run.concurrency,
        "replicas": run.replicas,
        "per_tenant": tenants,
        "per_replica": replicas,
    }


def build_report(
    runs: Sequence[PassRun],
    offline: dict,
    rates: Rates,
    block_size: int,
    *,
    meta: dict | None = None,
    decode=None,
    isolation: dict | None = None,
) -> dict:
    """The whole report.json document: offline figures, every pass, every request, attribution, summary."""
    with paused_gc():
        return _build_report(runs, offline, rates, block_size, meta, decode, isolation)


def _build_report(runs, offline, rates, block_size, meta, decode, isolation) -> dict:
    drifts: list[dict] = []
    reasons: list[dict[str, int]] = []
    group: list[PassRun] = []
    for run in [*runs, None]:  # runs sent to one server share its history; a fresh server starts anew
        if run is None or (run.fresh_fleet and group):
            analyzer = MissAnalyzer(block_size, decode)
            reasons += analyzer.run([s for g in group for s in g.sent])
            drifts += analyzer.drifts
            group = []
        if run is not None:
            group.append(run)
    passes: dict[str, dict] = {}
    requests: list[dict] = []
    k = 0
    for run in runs:
        mine = reasons[k : k + len(run.sent)]
        k += len(run.sent)
        passes[run.name] = pass_figures(run, mine, rates)
        for s, r in zip(run.sent, mine):
            requests.append(
                {
                    "id": s.prepared.req.id,
                    "pass": run.name,
                    "tenant": s.prepared.tok.tenant,
                    "prompt_tokens": s.prompt_tokens,
                    "cached_tokens": s.cached_tokens,
                    "replica": s.replica,
                    "miss_tokens": r,
                    "error": s.error,
                    "ttft_s": None if s.error is not None or s.ready_s is None else s.ready_s - s.start_s,
                }
            )
    by_name = {r.name: r for r in runs}
    report = {
        "schema_version": SCHEMA_VERSION,
        "meta": dict(meta or {}, block_size=block_size, rates=vars(rates)),
        "offline": offline,
        "passes": passes,
        "correctness": _correctness(by_name.get("cold"), by_name.get("warm")),
        "isolation": isolation or {"run": False, "why": "needs keys of two tenants"},
        "drift_examples": sorted(drifts, key=lambda d: -d["drift_tokens"])[:10],
        "requests": requests,
        "token_counts": token_counts(runs),
    }
    report["summary"] = summary(report)
    return report


# the client's tokenizer counts a prompt differently from the server when their counts differ by more than
# this share, on more than half of the logged prompts answered
TOKEN_COUNT_TOLERANCE = 0.03


def token_counts(runs: Sequence[PassRun]) -> dict:
    """The server's prompt token counts against the client tokenizer's, over the logged prompts answered with
    a cached-token count (the partial passes' token-id prompts are counted alike by both, so left out). A
    tokenizer other than the served model's gives other token ids: the offline bound, block hashes and miss
    reasons would describe another token stream than the one measured."""
    compared = differing = client = server = 0
    for run in runs:
        for s in run.sent:
            if s.error is not None or s.cached_tokens is None or s.prepared.origin is not None:
                continue
            n = s.prepared.tok.n
            compared += 1
            client += n
            server += s.prompt_tokens
            differing += abs(s.prompt_tokens - n) > TOKEN_COUNT_TOLERANCE * max(n, 1)
    return {
        "compared": compared,
        "differing": differing,
        "client_prompt_tokens": client,
        "server_prompt_tokens": server,
    }


def tokenizer_mismatch(report: dict) -> str | None:
    """The warning when the server counted most logged prompts' tokens differently from the client."""
    tc = report.get("token_counts") or {}
    if not tc.get("compared") or tc["differing"] <= tc["compared"] / 2:
        return None
    return (
        f"the server counted {tc['server_prompt_tokens']:,} prompt tokens where the client's tokenizer counted "
        f"{tc['client_prompt_tokens']:,} ({tc['differing']} of {tc['compared']} prompts differ by more than "
        f"{TOKEN_COUNT_TOLERANCE:.0%}): the offline bound, drift and miss reasons use another tokenizer's ids; "
        "pass --tokenizer with the served model's folder"
    )


def _correctness(cold: PassRun | None, warm: PassRun | None) -> dict:
    """Greedy outputs of the warm pass against the cold pass's, request by request."""
    if cold is None or warm is None:
        return {"compared": 0, "equal": 0, "ok": None, "differing_ids": []}
    both = [i for i in warm.outputs if i in cold.outputs]
    differ = [i for i in both if warm.outputs[i] != cold.outputs[i]]
    # no request answered in both passes: nothing compared, so no verdict (not "correct")
    ok = not differ if both else None
    return {"compared": len(both), "equal": len(both) - len(differ), "ok": ok, "differing_ids": differ[:20]}


def summary(report: dict) -> dict:
    """The headline: the main pass's hit rate (`warm`, else `kvmesh`, else the first pass) and what the cache
    changed in cost and TTFT against no caching (the cold pass's TTFT, every input token at the uncached
    rate) and against round robin where it was run. A comparison between two passes is over the requests
    answered in both (by request id), with the number compared: a request that failed in one pass would
    otherwise drop out of one side only (a pass with failures looks cheaper, its p50 another population's).
    `warnings` say what would make the headline mislead (docs/cachetest.md lists them)."""
    passes = report["passes"]
    main = next((n for n in ("warm", "kvmesh") if n in passes), next(iter(passes), None))
    if main is None:
        return {}
    cur = passes[main]
    rates = Rates(**(report.get("meta") or {}).get("rates", {}))
    by_pass = _requests_by_pass(report.get("requests") or [])
    # the cold pass is no baseline for itself (--passes cold, or cold,partial: the first pass is cold)
    vs_cold = _paired(by_pass, main, "cold", rates) if main != "cold" and "cold" in passes else None
    out = {
        "pass": main,
        "hit_rate_tokens": cur["hit_rate_tokens"],
        "hit_rate_requests": cur["hit_rate_requests"],
        "requests_with_hit": cur["requests_with_hit"],
        "input_cost": cur["input_cost"],
        "input_cost_without_cache": cur["input_cost_without_cache"],
        "cost_change_vs_no_cache": _rel(cur["input_cost"], cur["input_cost_without_cache"]),
        "cost_per_interaction": cur["cost_per_interaction"],
        "ttft_p50_s": cur["ttft_p50_s"],
        "ttft_change_vs_cold": vs_cold["ttft_change"] if vs_cold else None,
        "ttft_compared_vs_cold": vs_cold["ttft_requests"] if vs_cold else None,
        "offline_infinite_hit_rate": report["offline"].get("infinite_cache", {}).get("hit_rate"),
        "errors": sum(p["errors"] for p in passes.values()),
        "correct": report["correctness"]["ok"],
        "isolated": report["isolation"].get("ok"),
    }
    if "round_robin" in passes and main != "round_robin":
        rr = _paired(by_pass, main, "round_robin", rates)
        out["cost_change_vs_round_robin"] = rr["cost_change"]
        out["cost_compared_vs_round_robin"] = rr["cost_requests"]
        out["ttft_change_vs_round_robin"] = rr["ttft_change"]
        out["ttft_compared_vs_round_robin"] = rr["ttft_requests"]
    cold = passes.get("cold")
    out["cold_hit_rate_tokens"] = cold["hit_rate_tokens"] if cold else None
    # the warm pass re-sends the log straight after cold: its figures are an upper bound, not first contact
    out["main_resent"] = main == "warm"
    warnings = [
        w
        for w in (
            _partial_warning(report),
            _warning(cur, out["cost_change_vs_no_cache"]),
            _above_bound(main, cur, out),
            _cold_not_reset(report, out),
            _errors_warning(passes),
            tokenizer_mismatch(report),
        )
        if w
    ]
    if warnings:
        out["warning"] = "; ".join(warnings)
        out["warnings"] = warnings
    return out


# a pass's hit rate "exceeds" the offline infinite-cache bound when it is above it by more than this
BOUND_SLACK = 0.05
# a pass with more than this share of its requests failed gets a warning
ERROR_SHARE_WARNING = 0.10


def _exceeds(hit: float | None, bound: float | None) -> bool:
    return hit is not None and bound is not None and hit > bound + BOUND_SLACK


def _above_bound(main: str, cur: dict, out: dict) -> str | None:
    """The main pass reused more than any cache could on the log's first contact: it re-sends prompts this
    test already sent, so it measures replay, not the application's traffic."""
    hit, bound = cur["hit_rate_tokens"], out["offline_infinite_hit_rate"]
    if main == "cold" or not _exceeds(hit, bound):
        return None
    cold = out["cold_hit_rate_tokens"]
    first = f"; the cold pass (first contact) hit {cold:.1%}" if cold is not None else ""
    return (
        f"the {main} pass hit {hit:.1%} of prompt tokens, above the {bound:.1%} an infinite cache reaches on the "
        f"log's first contact: it re-sends prompts this test had just sent, so its hit rate and cost change are "
        f"an upper bound, not what the application's own traffic would reuse{first}"
    )


def _cold_not_reset(report: dict, out: dict) -> str | None:
    """A cold pass above the bound on a server whose cache was not reset started warm: comparisons against
    it understate the cache."""
    meta = report.get("meta") or {}
    cold, bound = out["cold_hit_rate_tokens"], out["offline_infinite_hit_rate"]
    if "cold_reset" not in meta or meta["cold_reset"] is not None or not _exceeds(cold, bound):
        return None
    return (
        f"the cold pass hit {cold:.1%} of prompt tokens, above the {bound:.1%} bound, and the server's cache was "
        "not reset before it (no reset endpoint answered; vLLM offers one with VLLM_SERVER_DEV_MODE=1): it was "
        "not first contact, so the figures against cold understate what the cache saves"
    )


def _errors_warning(passes: dict) -> str | None:
    """Passes with many failed requests: their figures cover only the answered ones."""
    bad = [
        f"{p['errors']} of {p['requests']} requests of {name}"
        for name, p in passes.items()
        if p["requests"] and p["errors"] > ERROR_SHARE_WARNING * p["requests"]
    ]
    if not bad:
        return None
    return f"{', '.join(bad)} failed: the figures cover only the answered requests (see errors per tenant)"


def _partial_warning(report: dict) -> str | None:
    """A test stopped before its last pass: what is here is what ran."""
    why = (report.get("meta") or {}).get("partial")
    if not why:
        return None
    return f"partial report ({why}): passes that ran: {', '.join(report['passes']) or 'none'}"


def _warning(p: dict, cost_change: float | None) -> str | None:
    """What makes the main pass's headline misleading, if anything: most answers without a cached-token count
    (their hits are unknown, their input is billed as uncached), else many requests hitting while the cost
    barely moves (the reused prefixes are a small part of the prompts)."""
    answered = p["requests"] - p["errors"]
    uncounted = answered - p.get("counted_requests", answered)
    if answered and uncounted > answered / 2:
        return (
            f"{uncounted} of {answered} answers reported no cached-token count (usage.prompt_tokens_details."
            "cached_tokens): the hit rates cover only the rest, and the cost counts those answers' input as uncached"
        )
    share = p["requests_with_hit"]
    if share is not None and share > LOW_VALUE_REQUESTS_WITH_HIT and cost_change is not None:
        if cost_change > LOW_VALUE_COST_CHANGE:
            return (
                f"{share:.0%} of requests hit the cache but the input cost moved only {cost_change:+.1%}: "
                "the reused blocks are too small a part of the prompts to matter"
            )
    return None


# the low-value-hits warning: more than this share of requests hit, and the input cost fell by less than 5%
LOW_VALUE_REQUESTS_WITH_HIT = 0.5
LOW_VALUE_COST_CHANGE = -0.05


def _requests_by_pass(requests: Sequence[dict]) -> dict[str, dict[tuple[str, int], dict]]:
    """pass -> (request id, occurrence of that id in the pass) -> its row of report["requests"]."""
    out: dict[str, dict[tuple[str, int], dict]] = {}
    for r in requests:
        table = out.setdefault(r["pass"], {})
        k = 0
        while (r["id"], k) in table:  # ids are unique in a log; a repeated one pairs by occurrence
            k += 1
        table[(r["id"], k)] = r
    return out


def _paired(by_pass: dict, new: str, old: str, rates: Rates) -> dict:
    """Pass `new` against pass `old` over the requests answered in both (by request id): the change in
    input cost (each answer billed as `pass_figures` bills it) and in TTFT p50 (over those with a first
    token in both), with the number of requests each compares."""
    both = answered_in_both(by_pass.get(new, {}), by_pass.get(old, {}))
    cost_new = sum(rates.cost(x["prompt_tokens"], x["cached_tokens"] or 0) for x, _ in both)
    cost_old = sum(rates.cost(y["prompt_tokens"], y["cached_tokens"] or 0) for _, y in both)
    p50_new, p50_old, timed = ttft_p50s(both)
    return {
        "cost_change": _rel(cost_new, cost_old) if both else None,
        "cost_requests": len(both),
        "ttft_change": _rel(p50_new, p50_old),
        "ttft_requests": timed,
    }


def answered_in_both(a: Mapping, b: Mapping) -> list[tuple[dict, dict]]:
    """(row in a, row in b) for every request key answered (no error) in both runs, in a's order: two runs
    compared over the same requests (`kvmesh demo` pairs its runs the same way)."""
    return [(x, b[k]) for k, x in a.items() if k in b and x.get("error") is None and b[k].get("error") is None]


def ttft_p50s(both: Sequence[tuple[dict, dict]]) -> tuple[float | None, float | None, int]:
    """TTFT p50 of each side over the pairs with a first token in both, and how many such pairs."""
    timed = [(x["ttft_s"], y["ttft_s"]) for x, y in both if x.get("ttft_s") is not None and y.get("ttft_s") is not None]
    return _pct(sorted(t for t, _ in timed), 0.5), _pct(sorted(t for _, t in timed), 0.5), len(timed)


def _rel(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return new / old - 1.0

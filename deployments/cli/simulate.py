"""`kvmesh simulate`: replay a trace through simulated replicas per policy, with bounds; table, JSON, PNG."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from kvmesh.cluster.whole_file import atomic_write
from kvmesh.cluster.workloads import MAX_ENGINE_BLOCKS
from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import (
    INT64_MAX,
    MAX_RATE,
    float_up_to,
    int_up_to,
    non_negative_float,
    output_file,
    positive_float,
    positive_int,
    refuse_overwriting,
)
from kvmesh.deployments.replay import MAX_TOKENS_PER_BLOCK, ReplayConfig

# `kvmesh replay --max-tokens`'s default: a simulation of a replay (--tokens-per-block) decodes what it asks for
REPLAY_MAX_TOKENS = ReplayConfig.max_tokens

# tokens per trace block and per engine block: as `kvmesh replay --tokens-per-block` caps it (16 blocks of
# 8,192 tokens fill a 128K context); a huge one overflowed numpy (OverflowError) instead of failing at once
MAX_BLOCK_TOKENS = MAX_TOKENS_PER_BLOCK
# LMCache chunk in simulated blocks: 10M blocks are at least 10M tokens, the longest context of any model, so
# no prompt holds a larger chunk whole (and past 2^63-1 numpy overflowed)
MAX_TIER_CHUNK_BLOCKS = 10_000_000

# Why 100,000: set-up is near linear in replicas (100,000 take ~5 s per policy) and each request scans the
# fleet; a million would take minutes per policy. (A live app's limit is config.MAX_REPLICAS.)
MAX_SIM_REPLICAS = 100_000
MAX_ROUTERS = 1_000  # each router keeps its own index and policy
# --load: 0.001 is an idle fleet (a lower load changes nothing but stretches arrivals until their times lose the
# milliseconds a TTFT is made of: 1e-15 gave a p50 TTFT of 0, 1e-308 NaN); at 1,000 every request queues at once
MIN_LOAD, MAX_LOAD = 1e-3, 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake JSONL file, or a bundled trace: conversation, synthetic")
    p.add_argument(
        "--replicas",
        type=int_up_to(MAX_SIM_REPLICAS),
        required=True,
        help=f"number of engine replicas (<= {MAX_SIM_REPLICAS:,})",
    )
    p.add_argument(
        "--capacity-blocks", type=int_up_to(INT64_MAX), required=True, help="HBM KV blocks per replica (<= 2^63-1)"
    )
    p.add_argument("--policies", default="all", help="comma-separated policy names, or 'all' (default)")
    p.add_argument(
        "--load",
        type=float_up_to(MAX_LOAD, minimum=MIN_LOAD),
        default=None,
        help="scale arrivals so offered prefill work (no reuse) / fleet prefill capacity = LOAD "
        f"({MIN_LOAD:g}-{MAX_LOAD:g}); default: trace timestamps as recorded",
    )
    p.add_argument(
        "--host-blocks",
        type=int_up_to(INT64_MAX, minimum=0),
        default=0,
        help="host-tier (LMCache L1) blocks per node (<= 2^63-1)",
    )
    p.add_argument("--shared", action="store_true", help="add a shared tier (LMCache L2) reachable from every replica")
    p.add_argument(
        "--shared-blocks",
        type=int_up_to(INT64_MAX),
        default=None,
        help="with --shared: the shared tier's capacity (default unbounded; <= 2^63-1); refused without --shared",
    )
    p.add_argument("--replicas-per-node", type=positive_int, default=1, help="replicas sharing one host tier")
    p.add_argument(
        "--tier-store-at",
        choices=("routed", "computed"),
        default="routed",
        help="when a computed block becomes loadable from the host and shared tiers: when its request is "
        "placed (default; early by up to the computing request's queueing and prefill) or when its prefill ends, "
        "as LMCache stores it",
    )
    p.add_argument(
        "--tier-chunk-blocks",
        type=int_up_to(MAX_TIER_CHUNK_BLOCKS),
        default=1,
        help="LMCache chunk size in simulated blocks (chunk tokens / block size): the host and shared tiers "
        f"store, and a prefix loads from them, in whole chunks (default 1; <= {MAX_TIER_CHUNK_BLOCKS:,})",
    )
    p.add_argument(
        "--block-size",
        type=int_up_to(MAX_BLOCK_TOKENS),
        default=None,
        help="without --tokens-per-block: tokens per trace hash id (default 512, Mooncake's); with it: "
        f"the engine's block size (default: tokens per block); <= {MAX_BLOCK_TOKENS:,}",
    )
    p.add_argument(
        "--tokens-per-block",
        type=int_up_to(MAX_BLOCK_TOKENS),
        default=None,
        help="expand each trace hash id (512 tokens in the file) to this many tokens, as `kvmesh replay` "
        f"does, and simulate at --block-size: the live run's prompts and block size (<= {MAX_BLOCK_TOKENS:,}; "
        f"the trace may expand to at most {MAX_ENGINE_BLOCKS:,} engine blocks)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="cap on output tokens per request, as `kvmesh replay --max-tokens`: each request decodes "
        f"min(this, its scaled output length); default {REPLAY_MAX_TOKENS} (the replay's) with --tokens-per-block, "
        "none without it (the trace's output lengths as recorded)",
    )
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="send closed-loop, as `kvmesh replay --concurrency` does: N in flight, a user's next "
        "turn after its previous reply (default: trace timestamps, see --reply-wait)",
    )
    p.add_argument(
        "--reply-wait",
        choices=("on", "off"),
        default="on",
        help="without --concurrency, on a trace whose records name a `user`: send each request at its "
        "timestamp but a user's next turn no earlier than its previous reply's end, as a chat client "
        "can (default on); off: every request at its timestamp",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N requests")
    p.add_argument(
        "--routers",
        type=int_up_to(MAX_ROUTERS),
        default=1,
        help=f"routers (ingress replicas), each with its own index and policy; requests spread round robin "
        f"(<= {MAX_ROUTERS:,})",
    )
    p.add_argument(
        "--event-delay-ms",
        type=non_negative_float,
        default=0.0,
        help="engine KV/load events and router sync reach a router this late (default 0)",
    )
    p.add_argument(
        "--router-sync",
        choices=("on", "off"),
        default="on",
        help="routers publish their decisions to each other (default on); off: only engine events "
        "(no effect with one router)",
    )
    p.add_argument(
        "--churn-every-s",
        type=positive_float,
        default=None,
        help="replace one replica by a cold one (new id, empty HBM cache) every N simulated seconds (between "
        "two requests each replica is replaced at most once: the churns before its last leave no trace)",
    )
    p.add_argument(
        "--cost-model",
        default=None,
        metavar="JSON",
        help="time-model constants as a JSON object or a JSON file (see docs/simulator.md)",
    )
    rate = float_up_to(MAX_RATE)
    p.add_argument("--uncached-rate", type=rate, default=3.00, help=f"$ per 1M uncached tokens (<= {MAX_RATE:g})")
    p.add_argument("--cached-rate", type=rate, default=0.30, help=f"$ per 1M cached tokens (<= {MAX_RATE:g})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", dest="json_out", default=None, metavar="OUT", type=output_file, help="write the result document here"
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        type=output_file,
        help="write a PNG of hit rate and p90 TTFT per policy",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cost_model(text: str | None):
    """The cost model of `--cost-model`: a JSON object given inline (it starts with "{" or "["), else the path of a
    JSON file holding one. Why decide by the first character: a mistyped path tried as inline JSON was
    reported as "Expecting value: line 1 column 1", naming neither the file nor what was wrong with it."""
    from kvmesh.policies.cost_model import CostModel

    if text is None:
        return CostModel()
    inline = _cost_model_file(text) is None
    where = "--cost-model" if inline else f"--cost-model {text}"
    try:
        if inline:
            values = json.loads(text)
        else:
            with open(text, encoding="utf-8") as fh:
                values = json.load(fh)
    except OSError as exc:
        raise CliError(f"{where}: {exc.strerror or exc} (give a JSON object, or a JSON file)") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:
        raise CliError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CliError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(values, dict):
        raise CliError(f"{where}: expected a JSON object of cost model constants, got {type(values).__name__}")
    try:
        return CostModel.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise CliError(f"{where}: {exc}") from None


def _cost_model_file(text: str | None) -> str | None:
    """The file `--cost-model` names, or None where it gives the JSON inline (as `_cost_model` decides)."""
    if text is None or (text.lstrip().startswith(("{", "[")) and not os.path.exists(text)):
        return None
    return text


def _refuse_overwriting(args) -> None:
    """Refuse --json or --plot naming an input (the trace, a --cost-model file) or each other, before any work:
    the result would replace the file it was made from, or the PNG the JSON."""
    from kvmesh.cluster.trace import TraceError, resolve

    try:
        trace = resolve(args.trace)
    except TraceError:  # no such trace: the load says so
        trace = None
    refuse_overwriting(
        {"--json": args.json_out, "--plot": args.plot},
        {
            "the trace being read (--trace)": trace,
            "the cost model being read (--cost-model)": _cost_model_file(args.cost_model),
        },
    )


def _load(args):
    """The trace as the simulator takes it (its requests' users, if any, in `meta["users"]`)."""
    from kvmesh.cluster.trace import BlockFitError, TraceError, load_trace, read_records, resolve, trace_name
    from kvmesh.cluster.workloads import engine_trace

    if args.tokens_per_block is None:
        try:
            trace = load_trace(args.trace, args.block_size or 512, args.limit)
        except BlockFitError as exc:
            if args.block_size is None:
                raise CliError(str(exc)) from None
            raise CliError(
                f"{exc}: without --tokens-per-block, --block-size is the tokens each trace hash id stands for "
                f"(512 in Mooncake traces); to simulate engine blocks of {args.block_size} tokens, give "
                f"--tokens-per-block 512 --block-size {args.block_size} (each id expanded to 512 tokens, "
                "cut into engine blocks)"
            ) from None
        except TraceError as exc:
            raise CliError(str(exc)) from None
        if args.max_tokens is not None:  # asked for: the recorded lengths capped as a replay caps them
            for r in trace.requests:
                r.output_length = min(args.max_tokens, r.output_length)
            trace.meta["max_tokens"] = args.max_tokens
        return trace
    block = args.block_size or args.tokens_per_block
    if args.tokens_per_block % block:
        raise CliError(f"--tokens-per-block {args.tokens_per_block} must be a multiple of --block-size {block}")
    try:
        records = read_records(args.trace, args.limit, in_time_order=True)
        path = resolve(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    if not records:
        raise CliError(f"{args.trace}: no requests")
    try:
        trace = engine_trace(
            records,
            args.tokens_per_block,
            block,
            name=trace_name(args.trace),
            max_tokens=REPLAY_MAX_TOKENS if args.max_tokens is None else args.max_tokens,
        )
    except ValueError as exc:  # more engine blocks than MAX_ENGINE_BLOCKS
        raise CliError(f"{args.trace}: {exc}") from None
    trace.meta.update(path=path, limit=args.limit)
    return trace


def _router_setup(args):
    """The multi-router model's setup, or None for the single all-knowing router. One router has no peer to
    sync with, so `--router-sync off` alone leaves the one-router model."""
    from kvmesh.cluster.multi_router import RouterSetup

    sync = args.router_sync == "on" or args.routers == 1
    setup = RouterSetup(args.routers, args.event_delay_ms / 1000.0, sync, args.churn_every_s)
    return None if setup == RouterSetup() else setup


def _modelled_policies(names: list[str], every: bool, make) -> list[str]:
    """The policies the multi-router model can run, checked before any run: one named that reads load signals it
    does not model is refused (CliError); with `every` (--policies all) those are left out, said in one line on
    stderr. `make(name)` builds a policy."""
    from kvmesh.cluster.multi_router import check_modelled_signals

    kept, left_out = [], []
    for name in names:
        try:
            check_modelled_signals(make(name))
        except ValueError as exc:
            if not every:
                raise CliError(str(exc)) from None
            left_out.append(name)
            continue
        kept.append(name)
    if left_out:
        print(
            f"kvmesh simulate: --policies all leaves out {', '.join(left_out)} here: they read load signals the "
            "multi-router model (--routers above 1, --event-delay-ms, --churn-every-s) does not model",
            file=sys.stderr,
        )
    return kept


def _client(args, trace, cfg):
    """How requests are sent: closed loop (`--concurrency`), timed with each user's turns after their
    replies (a trace that names users), or None: every request at its timestamp."""
    from kvmesh.cluster.simulator import ClosedLoop

    if args.concurrency:
        return ClosedLoop(args.concurrency, trace.meta.get("users"))
    return ClosedLoop.replying(trace, cfg) if args.reply_wait == "on" else None


def run(args) -> int:
    from kvmesh.cluster.bounds import balance_bounded_bound
    from kvmesh.cluster.sim_report import format_table, plot
    from kvmesh.cluster.simulator import SimConfig, simulate
    from kvmesh.policies.registry import make_policy, parse_policy_list

    try:
        names = parse_policy_list(args.policies)
    except ValueError as exc:
        raise CliError(f"--policies: {exc}") from None
    if args.plot and not args.plot.lower().endswith(".png"):
        raise CliError(f"--plot: expected a .png path, got {args.plot!r}")
    if args.concurrency is not None and args.load is not None:
        raise CliError("give either --load (timed arrivals) or --concurrency (closed loop), not both")
    if args.concurrency is not None and args.reply_wait == "off":
        raise CliError("--concurrency always sends a user's next turn after its reply: drop --reply-wait off")
    if args.shared_blocks is not None and not args.shared:
        raise CliError("--shared-blocks sizes the shared tier: add --shared, or drop --shared-blocks")
    _refuse_overwriting(args)
    cost = _cost_model(args.cost_model)

    def make(name: str):
        return make_policy(name, seed=args.seed, **({"cost": cost} if name == "kvmesh" else {}))

    routers = _router_setup(args)
    try:
        if routers is not None:  # before the trace is read or any policy run
            from kvmesh.cluster.multi_router import check_tier_store_at

            check_tier_store_at(args.tier_store_at)
            names = _modelled_policies(names, args.policies.strip() == "all", make)
    except ValueError as exc:  # a policy parameter out of range, or what the multi-router model cannot do
        raise CliError(str(exc)) from None
    trace = _load(args)
    if len(trace) < 2 and args.load is not None:
        raise CliError("--load needs a trace with at least two requests at different times")
    cfg = SimConfig(
        args.replicas,
        args.capacity_blocks,
        host_blocks=args.host_blocks,
        shared=args.shared,
        shared_blocks=args.shared_blocks,
        replicas_per_node=args.replicas_per_node,
        tier_store_at=args.tier_store_at,
        tier_chunk_blocks=args.tier_chunk_blocks,
        load=args.load,
        cost=cost,
        uncached_rate=args.uncached_rate,
        cached_rate=args.cached_rate,
        seed=args.seed,
    )
    try:
        cfg.check()
        policies = {n: make(n) for n in names}
        progress = not args.no_progress and len(trace) * len(names) >= 20_000
        client = _client(args, trace, cfg)
        doc = simulate(trace, cfg, policies, progress=progress, client=client, routers=routers)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    # beside doc["bounds"] (whose keys other tools rely on): hit rate, imbalance reached, per-replica prefill
    doc["balance_bounded"] = balance_bounded_bound(trace.requests, trace.block_size, args.replicas)
    # the files first: a standard output that fails (a full disk, a closed pipe) must not cost them
    wrote = []
    try:
        if args.json_out:
            try:  # NaN and Infinity are not JSON: a reader would refuse the whole document
                text = json.dumps(doc, indent=1, allow_nan=False)
            except ValueError:
                raise CliError(f"--json {args.json_out}: the result holds NaN or an infinity; not written") from None
            with _writing("--json", args.json_out), atomic_write(args.json_out) as fh:
                fh.write(text)
            wrote.append(args.json_out)
        if args.plot:
            with _writing("--plot", args.plot):
                plot(doc, args.plot)
            wrote.append(args.plot)
        print(format_table(doc))
        sys.stdout.flush()
    finally:
        for path in wrote:
            print(f"wrote {path}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _writing(flag: str, path: str):
    """An OSError while writing `path` as one line naming it (a failed write or close, EIO or EPIPE, names no
    file: the dispatcher printed the error alone)."""
    try:
        yield
    except OSError as exc:
        raise CliError(f"{flag} {exc.filename or path}: {exc.strerror or exc}") from None

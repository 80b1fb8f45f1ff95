"""`kvmesh trace`: make workloads in Mooncake JSONL form and print a trace's cache bounds.

kvmesh trace synth --out chat.jsonl --tenants 2 --groups 2 --users 4 --turns 4 --seed 0
kvmesh trace flood --out flood.jsonl --requests 64 --system-blocks 8
kvmesh trace bounds --trace chat.jsonl --tokens-per-block 32 --replicas 4
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmesh.cluster import workloads
from kvmesh.cluster.bounds import record_bounds
from kvmesh.cluster.trace import (
    BUNDLED,
    MAX_TIMESTAMP_MS,
    MAX_TRACE_TOKENS,
    SOURCE_BLOCK_TOKENS,
    read_records,
    resolve,
    trace_name,
)
from kvmesh.cluster.whole_file import atomic_write
from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import (
    float_up_to,
    int_range_up_to,
    int_up_to,
    non_negative_int,
    output_file,
    positive_int,
    refuse_overwriting,
)
from kvmesh.deployments.cli.simulate import MAX_BLOCK_TOKENS, MAX_SIM_REPLICAS

# Limits on a generated trace, far above any real workload: past them a typo would write for hours (the
# product of --tenants --groups --users --turns is the request count). A million-request trace is common.
MAX_REQUESTS = 100_000_000
MAX_BLOCKS = 100_000  # trace blocks of 512 tokens in one prompt part: 51M tokens
MAX_HASH_IDS = 10_000_000_000  # hash ids written over the whole trace (a prompt lists its whole history)
MAX_MS = 10**12  # about 31 years


def _check_size(requests: int, hash_ids: int) -> None:
    """Refuse a trace too large to write, before any of it is made."""
    if requests > MAX_REQUESTS:
        raise CliError(f"kvmesh trace: {requests:,} requests, more than {MAX_REQUESTS:,}: make the trace smaller")
    if hash_ids > MAX_HASH_IDS:
        raise CliError(
            f"kvmesh trace: up to {hash_ids:,} hash ids, more than {MAX_HASH_IDS:,}: make the trace or its "
            "prompts smaller"
        )


def _check_records(longest_prompt_blocks: int, last_timestamp_ms: float) -> None:
    """Refuse a trace whose records `kvmesh simulate` and `trace bounds` would refuse (cluster.trace's limits)."""
    if longest_prompt_blocks * SOURCE_BLOCK_TOKENS > MAX_TRACE_TOKENS:
        raise CliError(
            f"kvmesh trace: prompts of up to {longest_prompt_blocks * SOURCE_BLOCK_TOKENS:,} tokens, more than "
            f"{MAX_TRACE_TOKENS:,} (a trace's limit): use fewer turns or smaller blocks"
        )
    if last_timestamp_ms > MAX_TIMESTAMP_MS:
        raise CliError(
            f"kvmesh trace: timestamps up to {last_timestamp_ms:,.0f} ms, more than {MAX_TIMESTAMP_MS:,} "
            "(a trace's limit): use shorter times or fewer requests"
        )


def _write(records, path: str, progress: bool = False) -> int:
    """`workloads.write_jsonl` (whole or not at all); an error names the path (a failed write, EPIPE or EIO,
    names no file)."""
    try:
        return workloads.write_jsonl(records, path, progress=progress)
    except OSError as exc:
        raise CliError(f"kvmesh trace: {exc.filename or path}: {exc.strerror or exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", required=True)

    s = sub.add_parser("synth", help="multi-tenant multi-turn chat workload")
    s.add_argument("--out", required=True, type=output_file, help="JSONL file to write")
    s.epilog = (
        f"tenants x groups x users x turns (the request count) must be <= {MAX_REQUESTS:,}, and the hash ids "
        f"of all prompts <= {MAX_HASH_IDS:,}, a prompt <= {MAX_TRACE_TOKENS:,} tokens and the last timestamp "
        f"<= {MAX_TIMESTAMP_MS:,} ms (what `kvmesh simulate` reads)"
    )
    s.add_argument("--tenants", type=positive_int, default=2)
    s.add_argument("--groups", type=positive_int, default=2, help="system prompts per tenant")
    s.add_argument("--users", type=positive_int, default=4, help="users per group")
    s.add_argument("--turns", type=positive_int, default=4, help="turns per user")
    s.add_argument(
        "--system-blocks",
        type=int_up_to(MAX_BLOCKS),
        default=8,
        help=f"system prompt length in 512-token blocks (<= {MAX_BLOCKS:,})",
    )
    s.add_argument(
        "--user-blocks",
        type=int_range_up_to(MAX_BLOCKS),
        default=(1, 2),
        help=f"new message blocks per turn: N or MIN-MAX (<= {MAX_BLOCKS:,})",
    )
    s.add_argument(
        "--reply-blocks",
        type=int_range_up_to(MAX_BLOCKS),
        default=(1, 2),
        help=f"reply blocks per turn: N or MIN-MAX (<= {MAX_BLOCKS:,})",
    )
    s.add_argument(
        "--start-spread-ms",
        type=int_up_to(MAX_MS, minimum=0),
        default=20_000,
        help="users start uniformly within this window (<= 10^12)",
    )
    s.add_argument(
        "--think-ms",
        type=int_up_to(MAX_MS, minimum=0),
        default=10_000,
        help="mean pause between a user's turns (<= 10^12)",
    )
    s.add_argument("--seed", type=int, default=0)

    f = sub.add_parser("flood", help="shared-system-prompt flood (hot-spot workload)")
    f.add_argument("--out", required=True, type=output_file, help="JSONL file to write")
    f.add_argument("--requests", type=int_up_to(MAX_REQUESTS), default=64, help=f"<= {MAX_REQUESTS:,}")
    f.add_argument("--system-blocks", type=int_up_to(MAX_BLOCKS), default=8, help=f"<= {MAX_BLOCKS:,}")
    f.add_argument("--unique-blocks", type=int_up_to(MAX_BLOCKS), default=1, help=f"<= {MAX_BLOCKS:,}")
    f.add_argument("--output-blocks", type=int_up_to(MAX_BLOCKS), default=1, help=f"<= {MAX_BLOCKS:,}")
    f.add_argument(
        "--interval-ms", type=float_up_to(MAX_MS), default=50.0, help="between two requests (finite, <= 10^12)"
    )
    f.add_argument("--tenant", default="t0")
    f.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bounds", help="infinite-cache and round-robin-over-N-infinite-caches hit rates")
    b.add_argument("--trace", required=True, help="JSONL path or a bundled name: " + ", ".join(BUNDLED))
    b.add_argument(
        "--tokens-per-block",
        type=int_up_to(MAX_BLOCK_TOKENS),
        default=512,
        help=f"tokens per trace block after scaling (<= {MAX_BLOCK_TOKENS:,}, as `kvmesh replay`)",
    )
    b.add_argument(
        "--block-size",
        type=int_up_to(MAX_BLOCK_TOKENS),
        default=None,
        help=f"engine block size (default: tokens-per-block; <= {MAX_BLOCK_TOKENS:,})",
    )
    b.add_argument(
        "--replicas",
        type=int_up_to(MAX_SIM_REPLICAS),
        default=4,
        help=f"round-robin replicas (<= {MAX_SIM_REPLICAS:,})",
    )
    b.add_argument("--limit", type=positive_int, default=None)
    b.add_argument(
        "--warmup", type=non_negative_int, default=0, help="first N (>= 0) records fill the caches uncounted"
    )
    b.add_argument("--json", default=None, type=output_file, help="also write the result here")


def run(args: argparse.Namespace) -> int:
    try:
        if args.trace_command == "synth":
            spec = workloads.ChatSpec(
                tenants=args.tenants,
                groups=args.groups,
                users=args.users,
                turns=args.turns,
                system_blocks=args.system_blocks,
                user_blocks=args.user_blocks,
                reply_blocks=args.reply_blocks,
                start_spread_ms=args.start_spread_ms,
                think_ms=args.think_ms,
                seed=args.seed,
            )
            total = args.tenants * args.groups * args.users * args.turns
            conversations = args.tenants * args.groups * args.users
            # a turn's prompt lists the system prompt and every earlier message and reply
            per_turn = args.user_blocks[1] + args.reply_blocks[1]
            _check_size(
                total, total * args.system_blocks + conversations * per_turn * args.turns * (args.turns + 1) // 2
            )
            # a user's last turn: its first at most --start-spread-ms, each next one at most 1.5 x --think-ms later
            _check_records(
                args.system_blocks + args.turns * per_turn - args.reply_blocks[1],
                args.start_spread_ms + (args.turns - 1) * args.think_ms * 1.5,
            )
            if total >= 100_000:
                print(f"generating {total:,} requests ...", file=sys.stderr, flush=True)
            # made as written (ChatRecords): a few dozen bytes a request are held, not the records (~0.7 kB each)
            n = _write(workloads.ChatRecords(spec), args.out, progress=total >= 100_000)
            print(f"wrote {n} requests to {args.out}")
            return 0
        if args.trace_command == "flood":
            _check_size(args.requests, args.requests * (args.system_blocks + args.unique_blocks))
            _check_records(args.system_blocks + args.unique_blocks, (args.requests - 1) * args.interval_ms)
            flood = workloads.flood_records(  # made as written
                requests=args.requests,
                system_blocks=args.system_blocks,
                unique_blocks=args.unique_blocks,
                interval_ms=args.interval_ms,
                output_blocks=args.output_blocks,
                tenant=args.tenant,
                seed=args.seed,
            )
            n = _write(flood, args.out)
            print(f"wrote {n} requests to {args.out}")
            return 0
        refuse_overwriting({"--json": args.json}, {"the trace being read": resolve(args.trace)}, "kvmesh trace: ")
        # in time order, as `kvmesh simulate` reads a trace: a bound's warm-up and round robin follow that order
        records = read_records(args.trace, limit=args.limit, in_time_order=True)
        if not records:  # as `kvmesh simulate` refuses it: no bound of nothing
            raise CliError(f"kvmesh trace: trace {args.trace!r}: no requests")
        if args.warmup >= len(records):
            raise CliError(
                f"kvmesh trace: --warmup {args.warmup} leaves no request to measure: the trace has "
                f"{len(records):,}" + (f" (--limit {args.limit})" if args.limit else "")
            )
        result = record_bounds(records, args.tokens_per_block, args.block_size, args.replicas, warmup=args.warmup)
    except ValueError as exc:
        raise CliError(f"kvmesh trace: {exc}") from None
    result = {"trace": trace_name(args.trace), "limit": args.limit, **result}
    if args.json:  # before the summary: a standard output that fails must not cost the file
        try:
            with atomic_write(args.json) as fh:
                json.dump(result, fh, indent=2)
        except OSError as exc:  # a failed write or close (EIO, EPIPE) names no file
            raise CliError(f"kvmesh trace: {exc.filename or args.json}: {exc.strerror or exc}") from None
    print(
        f"{_measured(result, len(records))}, {result['prompt_tokens']} prompt tokens "
        f"({result['tokens_per_block']} tokens/block, engine block {result['block_size']})\n"
        f"  infinite cache:                    hit rate {result['infinite']['hit_rate']:.3f}\n"
        f"  round robin over {args.replicas} infinite caches: "
        f"hit rate {result['round_robin_infinite']['hit_rate']:.3f}"
    )
    return 0


def _measured(result: dict, read: int) -> str:
    """How many requests the bounds count and, with --limit or --warmup, which."""
    text = f"{result['requests']} requests"
    if not result["warmup"] and result["limit"] is None:
        return text
    which = f"the first {read} of the trace" if result["limit"] is not None else f"all {read} of the trace"
    if result["warmup"]:
        return f"{text} ({which} less {result['warmup']} warm-up requests, which fill the caches uncounted)"
    return f"{text} ({which}: --limit {result['limit']})"

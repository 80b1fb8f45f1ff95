"""`kvmesh trace`: make workloads in Mooncake JSONL form and print a trace's cache bounds.

kvmesh trace synth --out chat.jsonl --tenants 2 --groups 2 --users 4 --turns 4 --seed 0
kvmesh trace flood --out flood.jsonl --requests 64 --system-blocks 8
kvmesh trace bounds --trace chat.jsonl --tokens-per-block 32 --replicas 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvmesh.cluster import workloads
from kvmesh.cluster.bounds import record_bounds
from kvmesh.cluster.trace import BUNDLED, read_records, resolve
from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import (
    float_up_to,
    int_range_up_to,
    int_up_to,
    non_negative_int,
    output_file,
    positive_int,
)
from kvmesh.deployments.cli.simulate import MAX_SIM_REPLICAS

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


def _check_not_input(out: str | None, trace_path: str) -> None:
    """Refuse an output file that is the trace being read: writing the result would destroy the input."""
    if out and os.path.exists(out) and os.path.samefile(out, trace_path):
        raise CliError(f"kvmesh trace: --json {out} is the trace being read: name another file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", required=True)

    s = sub.add_parser("synth", help="multi-tenant multi-turn chat workload")
    s.add_argument("--out", required=True, help="JSONL file to write")
    s.epilog = (
        f"tenants x groups x users x turns (the request count) must be <= {MAX_REQUESTS:,}, and the hash ids "
        f"of all prompts <= {MAX_HASH_IDS:,}"
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
    f.add_argument("--out", required=True)
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
    b.add_argument("--tokens-per-block", type=positive_int, default=512, help="tokens per trace block after scaling")
    b.add_argument(
        "--block-size", type=positive_int, default=None, help="engine block size (default: tokens-per-block)"
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
            if total >= 100_000:
                print(f"generating {total:,} requests ...", file=sys.stderr, flush=True)
            n = workloads.write_jsonl(workloads.synth_chat(spec), args.out, progress=total >= 100_000)
            print(f"wrote {n} requests to {args.out}")
            return 0
        if args.trace_command == "flood":
            _check_size(args.requests, args.requests * (args.system_blocks + args.unique_blocks))
            records = workloads.synth_flood(
                requests=args.requests,
                system_blocks=args.system_blocks,
                unique_blocks=args.unique_blocks,
                interval_ms=args.interval_ms,
                output_blocks=args.output_blocks,
                tenant=args.tenant,
                seed=args.seed,
            )
            n = workloads.write_jsonl(records, args.out)
            print(f"wrote {n} requests to {args.out}")
            return 0
        _check_not_input(args.json, resolve(args.trace))
        records = read_records(args.trace, limit=args.limit)
        if not records:  # as `kvmesh simulate` refuses it: no bound of nothing
            raise CliError(f"kvmesh trace: trace {args.trace!r}: no requests")
        if args.warmup >= len(records):
            raise CliError(
                f"kvmesh trace: --warmup {args.warmup} leaves no request to measure: the trace has "
                f"{len(records):,}" + (f" (--limit {args.limit})" if args.limit else "")
            )
        result = record_bounds(records, args.tokens_per_block, args.block_size, args.replicas, warmup=args.warmup)
    except OSError as exc:
        raise CliError(f"kvmesh trace: {exc.strerror or exc}: {exc.filename}") from None
    except ValueError as exc:
        raise CliError(f"kvmesh trace: {exc}") from None
    print(
        f"{result['requests']} requests, {result['prompt_tokens']} prompt tokens "
        f"({result['tokens_per_block']} tokens/block, engine block {result['block_size']})\n"
        f"  infinite cache:                    hit rate {result['infinite']['hit_rate']:.3f}\n"
        f"  round robin over {args.replicas} infinite caches: "
        f"hit rate {result['round_robin_infinite']['hit_rate']:.3f}"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0

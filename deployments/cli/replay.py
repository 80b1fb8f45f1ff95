"""`kvmesh replay`: replay a Mooncake-form trace against a live OpenAI-compatible endpoint.

    kvmesh replay --url http://127.0.0.1:8000 --trace chat.jsonl --tokens-per-block 32 \\
        --concurrency 4 --api-key KEY --json out/replay.json

See deployments/replay.py for how prompts are built and what is measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmesh.cluster.whole_file import atomic_write
from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import (
    given,
    int_up_to,
    non_negative_float,
    output_file,
    positive_float,
    positive_int,
    printable,
    refuse_overwriting,
    url,
)
from kvmesh.deployments.replay import MAX_TOKENS_PER_BLOCK, ReplayConfig, ReplayError


def _tenant_key(text: str) -> tuple[str, str]:
    tenant, sep, key = text.partition("=")
    if not sep or not tenant or not key:
        raise argparse.ArgumentTypeError(f"expected TENANT=KEY, got {text!r}")
    return tenant, key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, type=url, help="base URL of the endpoint, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--trace", required=True, type=given, help="Mooncake JSONL path or a bundled name (conversation, synthetic)"
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int_up_to(MAX_TOKENS_PER_BLOCK),
        default=32,
        help=f"tokens per trace block (a multiple of the engine block size; <= {MAX_TOKENS_PER_BLOCK:,})",
    )
    parser.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests")
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        help="drop requests whose scaled prompt is longer (fit a small model's context)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=positive_int, default=None, help="requests in flight (default 4)")
    mode.add_argument(
        "--time-scale",
        type=non_negative_float,
        default=None,
        help="send at trace timestamp x this factor (0.5 = twice as fast); the scaled trace must span a day or less",
    )
    parser.add_argument("--api-key", type=given, default=None, help="bearer key for every request")
    parser.add_argument(
        "--tenant-key",
        type=_tenant_key,
        action="append",
        default=[],
        metavar="TENANT=KEY",
        help="key for the trace's `tenant` field (repeatable); falls back to --api-key",
    )
    parser.add_argument("--prompt-form", choices=("tokens", "text"), default="tokens")
    parser.add_argument("--tokenizer", type=given, default=None, help="tokenizer dir (needed for --prompt-form text)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=ReplayConfig.max_tokens,
        help=f"cap on output tokens per request (default {ReplayConfig.max_tokens}; `kvmesh simulate "
        "--tokens-per-block` decodes as many)",
    )
    parser.add_argument("--model", type=given, default=None, help="model name (default: first of GET /v1/models)")
    parser.add_argument(
        "--label", type=given, default=None, help="replica name when the server sends no x-kvmesh-replica"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="changes every block's tokens (a fresh, cold token space per run on warm servers)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        help="seconds a request may take from its send to its stream's end, keep-alives or slow tokens included; "
        "one that takes longer counts as an error (> 0)",
    )
    parser.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", required=True, type=output_file, help="write the summary JSON here")


def run(args: argparse.Namespace) -> int:
    from kvmesh.cluster.trace import read_records, resolve
    from kvmesh.cluster.workloads import fit_context
    from kvmesh.deployments.replay import ReplayConfig, format_table, replay

    try:
        refuse_overwriting({"--json": args.json}, {"the trace being read": resolve(args.trace)}, "kvmesh replay: ")
        records = read_records(args.trace, limit=None if args.max_prompt_tokens else args.limit)
    except ValueError as exc:
        raise CliError(f"kvmesh replay: {printable(str(exc))}") from None
    if args.max_prompt_tokens:
        records = fit_context(records, args.tokens_per_block, args.max_prompt_tokens)[: args.limit]
    if not records:
        raise CliError("kvmesh replay: no requests to replay")
    cfg = ReplayConfig(
        url=args.url,
        tokens_per_block=args.tokens_per_block,
        concurrency=args.concurrency,
        time_scale=args.time_scale,
        api_key=args.api_key,
        tenant_keys=dict(args.tenant_key),
        prompt_form=args.prompt_form,
        max_tokens=args.max_tokens,
        model=args.model,
        tokenizer=args.tokenizer,
        timeout_s=args.timeout,
        label=args.label,
        seed=args.seed,
        progress=not args.no_progress,
    )
    try:
        report = replay(records, cfg, keep_partial=True)
    except ReplayError as exc:
        raise CliError(f"kvmesh replay: {printable(str(exc))}") from None
    out = report.to_json(per_request=args.per_request)
    # whole or not at all (makes the folders): a failed write cut the summary short, leaving invalid JSON
    with atomic_write(args.json) as fh:
        json.dump(out, fh, indent=2)
    print(format_table({args.label or "replay": out}))
    if out["errors"]:
        print(f"{out['errors']} errors, e.g. {out['error_samples'][0]}")
    if report.interrupted:  # Ctrl-C: the answered requests are written (marked partial), the status says so
        print(
            f"interrupted: {len(report.results):,} of {len(records):,} requests answered before it; "
            f'{args.json} holds them ("partial": true)',
            file=sys.stderr,
        )
        return 130
    # the input was fine but the run failed (the summary is written all the same): 1, not 2
    return 1 if out["errors"] == out["requests"] else 0

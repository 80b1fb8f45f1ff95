"""`kvmesh cachetest`: does the prefix cache pay on this traffic, and why did each missed token miss?

    kvmesh cachetest --url URL --requests LOG.jsonl --out DIR [--api-key KEY | --tenant-key T=KEY ...]
                     [--passes cold,warm,partial] [--concurrency N | --concurrency-sweep 1,4,16]
                     [--uncached-rate 3.00 --cached-rate 0.30]
    kvmesh cachetest --serve [--replicas N] [--replicas-sweep 1,2,4] --requests LOG.jsonl --out DIR

Writes DIR/report.json (schema: docs/cachetest.md), PNG plots and DIR/report.html (self-contained).
The default log is the bundled example (`cluster/traces/app_log.jsonl`); `--trace` takes a Mooncake trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmesh.deployments.cli import CliError
from kvmesh.deployments.cli.args import (
    MAX_RATE,
    float_up_to,
    given,
    int_up_to,
    output_folder,
    positive_float,
    positive_int,
    printable,
    url,
)
from kvmesh.deployments.replay import MAX_TOKENS_PER_BLOCK, shown


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _tenant_key(text: str) -> tuple[str, str]:
    tenant, sep, key = text.partition("=")
    if not sep or not tenant or not key:
        raise argparse.ArgumentTypeError(f"expected TENANT=KEY, got {text!r}")
    return tenant, key


def default_log() -> str:
    import kvmesh.cluster as cluster_pkg

    return str(Path(next(iter(cluster_pkg.__path__))) / "traces" / "app_log.jsonl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", type=url, help="OpenAI-compatible base URL (kvmesh, vLLM, a peer router)")
    where.add_argument("--serve", action="store_true", help="start kvmesh (tiny model) for the test, stop it after")
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--requests", type=given, help="request log, JSONL of OpenAI bodies (default: the bundled example)"
    )
    src.add_argument("--trace", type=given, help="a Mooncake trace (path or bundled name) instead of a request log")
    parser.add_argument(
        "--out",
        required=True,
        type=output_folder("report.json"),
        help="output folder (report.json, *.png, report.html)",
    )
    parser.add_argument(
        "--api-key",
        type=given,
        help="bearer key for every request without a --tenant-key; against kvmesh, an operator's key also reads "
        "the server's counters and every request's record whole",
    )
    parser.add_argument("--tenant-key", type=_tenant_key, action="append", default=[], metavar="TENANT=KEY")
    parser.add_argument("--passes", default="cold,warm,partial", help="comma-separated: cold, warm, partial")
    conc = parser.add_mutually_exclusive_group()
    conc.add_argument("--concurrency", type=positive_int, default=None, help="requests in flight (default 4)")
    conc.add_argument("--concurrency-sweep", type=_int_list, default=None, help="e.g. 1,4,16 (warm passes)")
    rate = float_up_to(MAX_RATE)
    parser.add_argument("--uncached-rate", type=rate, default=3.00, help=f"$ per 1M uncached tokens (<= {MAX_RATE:g})")
    parser.add_argument("--cached-rate", type=rate, default=0.30, help=f"$ per 1M cached tokens (<= {MAX_RATE:g})")
    parser.add_argument("--block-size", type=positive_int, default=32, help="the engines' KV block size")
    parser.add_argument("--tokenizer", type=given, help="the served model's folder (default: the tiny model)")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N requests of the log")
    parser.add_argument(
        "--trace-tokens-per-block",
        type=int_up_to(MAX_TOKENS_PER_BLOCK),
        default=32,
        help=f"with --trace (<= {MAX_TOKENS_PER_BLOCK:,})",
    )
    parser.add_argument("--timeout", type=positive_float, default=120.0, help="per-request timeout, s (> 0)")
    parser.add_argument("--replicas", type=positive_int, default=2, help="with --serve: engine replicas")
    parser.add_argument("--replicas-sweep", type=_int_list, default=None, help="with --serve: e.g. 1,2,4")
    parser.add_argument("--no-progress", action="store_true")


def _read(args) -> list:
    """The log's requests, or the trace's records, read and checked without building a prompt (cheap, so
    that bad input stops before the URL is contacted and before the prompts are built)."""
    from kvmesh.cluster.request_log import RequestLogError, read_request_log

    if args.trace:
        from kvmesh.cluster.trace import read_records

        try:
            records = read_records(args.trace, limit=args.limit)
        except ValueError as exc:
            raise CliError(f"--trace: {printable(str(exc))}") from None
        if not records:  # as an empty --requests log is: nothing to test
            raise CliError(f"--trace {shown(args.trace)}: no records")
        return records
    try:
        return read_request_log(args.requests or default_log(), limit=args.limit)
    except RequestLogError as exc:
        raise CliError(printable(str(exc))) from None


def _tenants(args, read: list) -> list[tuple[int, str | None]]:
    """(line, tenant) of each request `_read` returned, for the tenant-key check."""
    if not args.trace:
        return [(r.line, r.tenant) for r in read]
    return [(n, None if rec.get("tenant") is None else str(rec["tenant"])) for n, rec in enumerate(read, start=1)]


def _requests(args, read: list) -> list:
    """The requests to send: a trace's records become completions of token-id prompts (`read` from `_read`).
    Building them is the expensive part of the input (a block of up to 8,192 tokens per hash id), so it
    comes after the checks and the URL's answer."""
    if not args.trace:
        return read
    import json

    from kvmesh.cluster.request_log import parse_line
    from kvmesh.deployments.replay import PromptBuilder, ReplayConfig

    builder = PromptBuilder(ReplayConfig(url="", tokens_per_block=args.trace_tokens_per_block))
    out = []
    for n, rec in enumerate(read, start=1):
        line = {"id": f"trace-{n}", "body": {"prompt": builder.prompt(rec), "max_tokens": 8}}
        for k in ("tenant", "user"):
            if rec.get(k) is not None:
                line["tenant" if k == "tenant" else "interaction"] = str(rec[k])
        out.append(parse_line(json.dumps(line), args.trace, n))
    return out


def _tokenizer(path: str | None):
    from kvmesh.deployments.replay import ReplayError, load_tokenizer

    if path is None:
        from kvmesh.deployments.config import resolve_model

        path = resolve_model("tiny")
    try:
        return load_tokenizer(path)
    except ReplayError as exc:
        raise CliError(printable(str(exc))) from None


def run(args: argparse.Namespace) -> int:
    from kvmesh.cluster.cachetest_analysis import prepare
    from kvmesh.cluster.cachetest_report import Rates
    from kvmesh.cluster.request_log import RequestLogError
    from kvmesh.deployments.cachetest import CachetestConfig, CachetestError, discover

    if args.replicas_sweep and not args.serve:
        raise CliError("--replicas-sweep needs --serve (the test must start kvmesh itself)")
    read = _read(args)
    concurrency = args.concurrency_sweep or [args.concurrency or 4]
    cfg = CachetestConfig(
        url=args.url or "",
        api_key=args.api_key,
        tenant_keys=dict(args.tenant_key),
        passes=[p.strip() for p in args.passes.split(",") if p.strip()],
        concurrency=concurrency,
        rates=Rates(args.uncached_rate, args.cached_rate),
        block_size=args.block_size,
        timeout_s=args.timeout,
        bound_replicas=sorted({1, 2, 4, args.replicas, *(args.replicas_sweep or [])}),
    )
    try:
        cfg.check_passes()
        cfg.check_tenants(_tenants(args, read))
        if not args.serve:
            discover(cfg)  # an unreachable URL fails before the tokenizer loads and the prompts are built
    except CachetestError as exc:
        raise CliError(printable(str(exc))) from None
    tok = _tokenizer(args.tokenizer)
    try:  # a chat the model's template refuses is found only once it is rendered
        prepared = prepare(_requests(args, read), tok, args.block_size)
    except RequestLogError as exc:
        raise CliError(printable(str(exc))) from None
    from kvmesh.cluster.cachetest_html import remove_outputs, write_outputs

    try:  # an earlier run's report must not outlive a run stopped before it writes its own
        remove_outputs(args.out)
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    try:
        if args.serve:
            from kvmesh.deployments.cachetest_serve import serve_and_test

            report = serve_and_test(cfg, prepared, tok, args.replicas, args.replicas_sweep, not args.no_progress)
        else:
            report = _test_url(cfg, prepared, tok, not args.no_progress, args.out)
    except CachetestError as exc:
        raise CliError(printable(str(exc))) from None
    try:
        paths = write_outputs(report, args.out)
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    _print_summary(report)
    _warn_tokenizer(report)
    print(f"report: {paths['html']}")
    # the input was fine but the test failed (its report is written all the same): 1, not 2
    return 1 if all(p["requests"] and p["errors"] == p["requests"] for p in report["passes"].values()) else 0


def _test_url(cfg, prepared, tok, progress: bool, out: str | None = None) -> dict:
    """The test against `cfg.url`. Stopped by an interrupt (Ctrl-C, SIGTERM) or an error after a pass ran,
    it writes the passes done to `out` as a report marked partial before the stop goes on: a long test
    keeps what it measured."""
    from kvmesh.deployments.cachetest import Runner, offline_figures

    offline = offline_figures(prepared, cfg.block_size, cfg.bound_replicas)
    runner = Runner(cfg, prepared, tok, progress=progress)
    try:
        runner.run_all()
    except BaseException as exc:
        if out is not None and runner.runs and isinstance(exc, (Exception, KeyboardInterrupt)):
            _write_partial(runner, offline, out, exc)
        raise
    return runner.report(offline)


def _write_partial(runner, offline: dict, out: str, exc: BaseException) -> None:
    """The report of the passes `runner` finished, marked partial (meta.partial says where it stopped)."""
    from kvmesh.cluster.cachetest_html import write_outputs

    where = f"stopped in the {runner.current} pass" if runner.current else "stopped between passes"
    why = "interrupted" if isinstance(exc, KeyboardInterrupt) else printable(str(exc) or type(exc).__name__)
    try:
        report = runner.report(offline, meta={"partial": f"{why}, {where}"})
        write_outputs(report, out)
    except Exception as err:  # the stop itself is what the caller reports
        print(f"cachetest: partial report not written ({type(err).__name__})", file=sys.stderr)
        return
    print(f"partial report: {Path(out) / 'report.html'}", file=sys.stderr)


def _warn_tokenizer(report: dict) -> None:
    """One line on stderr when the server counted the prompts' tokens unlike the client's tokenizer."""
    from kvmesh.cluster.cachetest_report import tokenizer_mismatch

    warning = tokenizer_mismatch(report)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def _pct(v: float | None) -> str:
    return "  n/a" if v is None else f"{100 * v:5.1f}%"


def _ms(v: float | None) -> str:
    return "    n/a" if v is None else f"{1000 * v:7.1f}"


def _rel(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f}%"


def _verdict(v: bool | None) -> str:
    return "n/a" if v is None else ("yes" if v else "NO")


def _print_summary(report: dict) -> None:
    s = report.get("summary") or {}
    for name, p in report["passes"].items():
        print(
            f"{name:18} hit {_pct(p['hit_rate_tokens'])} tokens, "
            f"{_pct(p['requests_with_hit'])} of requests hit  "
            f"TTFT p50 {_ms(p['ttft_p50_s'])} ms  errors {p['errors']}  "
            f"misses {p['miss_tokens']}",
            file=sys.stdout,
        )
    if s:
        vs = []  # against another pass: over the requests answered in both
        if s.get("ttft_compared_vs_cold") is not None:
            vs.append(f"TTFT p50 vs cold {_rel(s['ttft_change_vs_cold'])} ({s['ttft_compared_vs_cold']} requests)")
        if "cost_change_vs_round_robin" in s:
            vs.append(
                f"input cost vs round robin {_rel(s['cost_change_vs_round_robin'])} "
                f"({s.get('cost_compared_vs_round_robin')} requests)"
            )
        print(
            f"{s['pass']} hit rate {_pct(s['hit_rate_tokens'])}, input cost vs no cache "
            f"{_rel(s['cost_change_vs_no_cache'])}, "
            + "".join(f"{v}, " for v in vs)
            + f"correct {_verdict(s['correct'])}, isolated {_verdict(s['isolated'])}"
        )
        if s.get("warning"):
            print(f"warning: {s['warning']}")

"""The `kvmesh` command line. Each subcommand lives in the module that owns its step; this file only
dispatches, and turns a `CliError` (or bad arguments) into one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "simulate": ("kvmesh.cluster.simulate_cmd", "replay a trace through simulated replicas, per policy, with bounds"),
    "trace": ("kvmesh.cluster.trace_cmd", "generate workloads (multi-tenant multi-turn chat) in Mooncake JSONL form"),
    "model": ("kvmesh.deployments.model_cmd", "build the tiny local model (random weights, local tokenizer)"),
    "serve": ("kvmesh.deployments.serve_cmd", "start Ray Serve with vLLM engine replicas and the kvmesh router"),
    "replay": ("kvmesh.deployments.replay_cmd", "replay a trace against a live OpenAI-compatible endpoint"),
    "demo": ("kvmesh.deployments.demo_cmd", "the embedded default: build, serve, replay kvmesh vs round robin"),
    "bench": ("kvmesh.benchmarks.peers_cmd", "side-by-side benchmarks (e.g. `kvmesh bench peers`)"),
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; we want one clear line
        raise CliError(f"{self.prog}: {message}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="prefix-cache-aware LLM serving on Ray Serve")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name and module.startswith(exc.name):
                    p.set_defaults(_missing=module)
                    continue
                raise
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        args = build_parser(only).parse_args(argv)
        if getattr(args, "_missing", None):
            raise CliError(f"kvmesh {args.command}: not available in this build ({args._missing} missing)")
        return int(args._run(args) or 0)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m kvmesh.deployments.cli` runs this file as __main__; subcommands raise kvmesh.deployments.cli.CliError,
    # a different class object than __main__.CliError, so dispatch through the imported module.
    from kvmesh.deployments.cli import main as _main

    sys.exit(_main())

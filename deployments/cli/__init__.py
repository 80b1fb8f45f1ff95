"""The `kvmesh` command line: one package for every subcommand (one module each) and their shared argument
types (`args`). This module dispatches and does what every subcommand shares: a SIGTERM unwinds the
subcommand as Ctrl-C does (exit status 143), so what it started is cleaned up; a `CliError`, bad
arguments or an `OSError` become one line on stderr and exit status 2; Ctrl-C exits 130. Standard output is
flushed before the exit status is decided: one that cannot be written (a full disk) is such an error too,
and one whose reader has gone (`| head`) ends the command quietly with status 1, as Python's own guidance
for a closed pipe has it. `kvmesh --version` (-V) prints the installed version. Library code never imports
this package: it raises its own errors, which the subcommands turn into `CliError`."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import select
import sys

# subcommand -> help; the subcommand's module is this package's module of the same name, with
# `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "simulate": "replay a trace through simulated replicas, per policy, with bounds",
    "trace": "generate workloads (multi-tenant multi-turn chat) in Mooncake JSONL form",
    "model": "build the tiny local model (random weights, local tokenizer)",
    "serve": "start Ray Serve with vLLM engine replicas and the kvmesh router",
    "replay": "replay a trace against a live OpenAI-compatible endpoint",
    "demo": "the embedded default: build, serve, replay kvmesh vs round robin",
    "bench": "side-by-side benchmarks (e.g. `kvmesh bench peers`)",
    "cachetest": "cold/warm/partial cache test of a request log, miss attribution, HTML report",
    "k8s": "render the KubeRay manifest's Serve config from a kvmesh config (`kvmesh k8s render`)",
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; we want one clear line
        raise CliError(f"{self.prog}: {message}")


class _Version(argparse.Action):
    """`kvmesh --version` (-V): "kvmesh <version>" on standard output, exit status 0, as argparse's own
    version action does; the installed distribution's version is looked up only when asked for (that reads
    the environment's package metadata, which every other command would pay for)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata

        try:
            version = metadata.version("kvmesh")
        except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
            version = "(version unknown: the kvmesh distribution is not installed)"
        print(f"kvmesh {version}")
        parser.exit()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmesh", description="prefix-cache-aware LLM serving on Ray Serve")
    parser.add_argument("-V", "--version", action=_Version, help="print kvmesh's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                mod = importlib.import_module(f"{__name__}.{name}")
                mod.add_arguments(p)
            except ModuleNotFoundError as exc:
                # a part of kvmesh this build leaves out (e.g. kvmesh.benchmarks for `bench`)
                if exc.name and exc.name.split(".")[0] == "kvmesh":
                    p.set_defaults(_missing=exc.name)
                    continue
                raise
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A SIGTERM unwinds it like Ctrl-C does (process_tree.exit_on_sigterm), so what it
    started (a local app, servers, temp folders) is cleaned up; the caller's handler is back afterwards."""
    from kvmesh.deployments.process_tree import sigterm_unwinds

    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    with sigterm_unwinds():
        return _run(argv, only)


def _run(argv: list[str], only: str | None) -> int:
    try:
        args = build_parser(only).parse_args(argv)
        if getattr(args, "_missing", None):
            raise CliError(f"kvmesh {args.command}: not available in this build ({args._missing} missing)")
        rc = int(args._run(args) or 0)
        sys.stdout.flush()  # here, not at exit: there a failure is "Exception ignored" and status 120
        return rc
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the command reads or writes: one line, as for any other bad input
        if _stdout_failed(exc):
            _silence_stdout()
            if exc.errno == errno.EPIPE:  # the reader has gone: nothing to tell it
                return 1
            print(f"error: standard output: {exc.strerror or exc}", file=sys.stderr)
            return 2
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _stdout_failed(exc: OSError) -> bool:
    """Whether `exc`, which names no file, is standard output failing: flushing it again fails too (what
    could not be written is still buffered), or it is a pipe whose reader has gone (what failed was written
    past the buffer)."""
    if exc.filename is not None:
        return False
    try:
        sys.stdout.flush()
    except OSError:
        return True
    except ValueError:  # closed
        return False
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's capture), no poll
        return False


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's flush at exit, which would fail again,
    has nowhere to fail (what was not written is lost either way)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)

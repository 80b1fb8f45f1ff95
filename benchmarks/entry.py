"""The `python -m kvmesh.benchmarks.<name>` entry of every benchmark module. A SIGTERM unwinds the run the way
Ctrl-C does, so its own clean-up (Ray, engines, servers, temporary folders) runs, as under `make bench`
(run_all) and the `kvmesh` CLI; Python's default would end the process at once and leave them behind."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from kvmesh.deployments.process_tree import sigterm_unwinds


def run_main(main: Callable[..., object], *args: object) -> NoReturn:
    """`main(*args)` with SIGTERM unwinding it (process_tree.sigterm_unwinds), then exit: with the status
    `main` returned where it is an int, else 0 (a bench's `main` returns its figures, or nothing)."""
    with sigterm_unwinds():
        result = main(*args)
    sys.exit(result if isinstance(result, int) else 0)

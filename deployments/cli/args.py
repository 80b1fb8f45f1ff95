"""Argument types shared by the subcommands (argparse `type=`), so one check gives one message everywhere.

A bad value raises `argparse.ArgumentTypeError`; the dispatcher prints it as one line and exits 2."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from kvmesh.cluster.trace import brief

INT64_MAX = 2**63 - 1  # numpy's int64 holds block counts: beyond it they overflow
# $ per 1M prompt tokens: far above any price (frontier models charge tens of $), and low enough that a cost
# summed over any trace stays finite (1e308 made it inf)
MAX_RATE = 1e6


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {brief(repr(text))}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {brief(repr(text))}") from None


def positive_int(text: str) -> int:
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def int_up_to(maximum: int, minimum: int = 1) -> Callable[[str], int]:
    """A whole number in [minimum, maximum]. Why an upper limit: a size far beyond any real one (a typo, an
    extra digit) would otherwise overflow numpy or run for hours instead of failing at once."""

    def parse(text: str) -> int:
        value = _whole(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {brief(str(value))}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:,}, got {brief(str(value))}")
        return value

    return parse


def _finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {brief(repr(text))}")
    return value


def float_up_to(maximum: float, minimum: float = 0.0) -> Callable[[str], float]:
    """A finite number in [minimum, maximum] (a time in ms, say): one too large to stay finite once multiplied
    by a count of requests fails here, not as a float overflow in the middle of the work; a lower limit above 0
    keeps a divisor from turning the work's times into inf, or too large to keep their milliseconds."""

    def parse(text: str) -> float:
        value = _finite(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {brief(text)}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {brief(text)}")
        return value

    return parse


def positive_float(text: str) -> float:
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def output_file(text: str) -> str:
    """A file this command may write, checked before its work starts (a live run's results must not be lost
    to a path that cannot be written at its end)."""
    path = Path(text).absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    folder = path.parent  # the nearest folder that exists: the command makes the rest
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: cannot be written here")
    return text


def output_folder(first_file: str) -> Callable[[str], str]:
    """An output folder (argparse type), checked before the work runs so that its results are not lost to a
    path that cannot be written at the end: a folder, or one to make, where `first_file` can be written."""

    def parse(text: str) -> str:
        if Path(text).exists() and not Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
        output_file(os.path.join(text, first_file))
        return text

    return parse


def int_range(text: str) -> tuple[int, int]:
    """'2' -> (2, 2); '1-3' -> (1, 3)."""
    lo, dash, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi if dash else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {brief(repr(text))}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {brief(repr(text))}")
    return pair


def int_range_up_to(maximum: int) -> Callable[[str], tuple[int, int]]:
    """`int_range` with MAX <= `maximum` (why a limit: `int_up_to`)."""

    def parse(text: str) -> tuple[int, int]:
        pair = int_range(text)
        if pair[1] > maximum:
            raise argparse.ArgumentTypeError(f"MAX must be <= {maximum:,}, got {brief(repr(text))}")
        return pair

    return parse


def choices_csv(choices) -> Callable[[str], tuple]:
    """A comma-separated, non-empty subset of `choices`, e.g. `--workloads chat,flood`."""

    def parse(text: str) -> tuple:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (got {text!r})")
        return items

    return parse

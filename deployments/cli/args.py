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
    if not text:  # Path("") is the current folder: "is a directory" named nothing the user wrote
        raise argparse.ArgumentTypeError("empty path: name a file")
    path = Path(text).absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    folder = existing_folder_above(text, path.parent)  # the nearest folder that exists: the command makes the rest
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: cannot be written here")
    return text


def existing_folder_above(text: str, folder: Path) -> Path:
    """The nearest of `folder` and its parents that exists, which must be a folder (else an argparse error
    naming `text`): a path below a file was refused as "File exists" (making its folders), naming the file
    as if it were the trouble."""
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: cannot be written here: {folder} is a file, not a folder")
    return folder


def _same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file: the same real path (links followed, `..` and `.` resolved),
    or, where both exist, the same file (a hard link, a folder mounted twice)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:  # a file that went meanwhile, or one that cannot be looked at: the open will say so
        return False


def given(text: str) -> str:
    """A value that is not empty (argparse type): `--api-key "$UNSET"` or `--config ""` would otherwise be
    taken for no value at all, and the command go on without it (a generated key, the default config)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a value, got an empty string")
    return text


def printable(text: str) -> str:
    """`text` with its control characters escaped: echoed input (a path with a newline) keeps the error
    message on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def url(text: str) -> str:
    """An http(s) base URL (argparse type): a bad one is refused before any record is read or request sent."""
    from kvmesh.deployments.replay import ReplayError, check_url

    try:
        return check_url(text)
    except ReplayError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def refuse_overwriting(outputs: dict[str, str | None], inputs: dict[str, str | None], prefix: str = "") -> None:
    """Refuse, before any work, an output file that is one of the command's inputs (writing it would destroy
    the input: `simulate --trace t.jsonl --json t.jsonl`) or another of its outputs (the second write would
    replace the first: `--json x.png --plot x.png`). `outputs`: option (e.g. "--json") -> path, or None where
    not given; `inputs`: what the input is ("the trace being read") -> its path, or None. Raises CliError."""
    from kvmesh.deployments.cli import CliError

    given = [(flag, path) for flag, path in outputs.items() if path]
    for i, (flag, path) in enumerate(given):
        for what, source in inputs.items():
            if source and _same_file(path, source):
                raise CliError(f"{prefix}{flag} {path} is {what}: name another file")
        for other_flag, other in given[:i]:
            if _same_file(path, other):
                raise CliError(f"{prefix}{other_flag} {other} and {flag} {path} are the same file: name two files")


def output_folder(first_file: str) -> Callable[[str], str]:
    """An output folder (argparse type), checked before the work runs so that its results are not lost to a
    path that cannot be written at the end: a folder, or one to make, where `first_file` can be written."""

    def parse(text: str) -> str:
        if Path(text).exists() and not Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
        if text:
            existing_folder_above(text, Path(text).absolute())
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

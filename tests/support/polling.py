"""Waiting on a live system from a test: poll a predicate until it holds, fail with what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.5) -> T:
    """The predicate's first truthy value, polled every `every` seconds; an assertion naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return value

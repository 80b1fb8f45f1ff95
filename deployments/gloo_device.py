"""One gloo transport device for every process group an in-process vLLM engine makes while it starts.

Why: vLLM initialises torch.distributed even for one rank and makes about a dozen gloo process groups (a
device group and a CPU group for each of its parallel dimensions). Torch gives every gloo group a transport
device of its own, and each device runs a TCP loop thread that wakes every 10 ms whether or not anything is
sent: 13 of them took 0.025 cores of an idle engine replica, and about 1 ms of CPU per request under load on
two cores (docs/serving.md, "One gloo device"). A gloo device is made to serve many contexts (one per group),
so the groups made inside `one_gloo_device()` share one, made the way torch makes its default device.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def one_gloo_device() -> Iterator[None]:
    """While open, every gloo process group torch makes (`torch.distributed.new_group`, its default group)
    gets the same transport device; torch's own class is back once it closes. A torch without gloo: no-op."""
    import torch.distributed.distributed_c10d as c10d

    base: Any = getattr(c10d, "ProcessGroupGloo", None)
    if base is None:
        yield
        return
    device = base.create_default_device()

    class SharedDeviceGloo(base):
        """torch's ProcessGroupGloo (isinstance checks hold) built on the shared device."""

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)) -> None:
            if not isinstance(timeout, datetime.timedelta):  # already given options: torch's own choice stays
                super().__init__(store, rank, size, timeout)
                return
            options = base._Options()
            options._devices = [device]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = base

"""Free TCP ports for the servers kvmesh starts, chosen where no other program is handed one by chance.

Why not the kernel's pick (bind to port 0 and close): that port comes from the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, usually 32768-60999), the range the kernel also gives every
outgoing connection and every other program asking for port 0. Between closing the probe and the
server's own bind, any of them may take it; on a machine running several vLLM engines, Ray and a
replay client at once that happened (a vLLM KV-event publisher failed with "Address already in use"
seconds after the port was probed). So ports are drawn at random below the ephemeral range and above
Ray's worker ports (10002-19999 by default), where the kernel never assigns one unasked, and each is
probed on every interface (a server binding `*` conflicts with one on any address). A port handed out
once is not handed out again by this process.
"""

from __future__ import annotations

import random
import socket

LOW = 20_000  # above Ray's default worker ports (min 10002, max 19999)
_DEFAULT_EPHEMERAL = (32_768, 60_999)
_given: set[int] = set()
_rng = random.SystemRandom()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux; the usual default elsewhere)."""
    try:
        with open(path, encoding="ascii") as fh:
            low, high = (int(x) for x in fh.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # a probe only: never listens; fails if any address holds the port
        except OSError:
            return False
    return True


def _kernel_pick(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free on every interface, outside the kernel's ephemeral range and Ray's worker ports.
    Falls back to the kernel's pick when that window is empty or full."""
    return free_ports(1, host, tries)[0]


def free_ports(n: int, host: str = "127.0.0.1", tries: int = 200) -> list[int]:
    """`n` distinct ports as `free_port` chooses them."""
    top = min(ephemeral_range()[0], 65_536)
    out: list[int] = []
    for _ in range(tries):
        if len(out) == n or top - LOW < 1000:
            break
        port = _rng.randrange(LOW, top)
        if port not in _given and _bindable(port):
            _given.add(port)
            out.append(port)
    while len(out) < n:  # no room below the ephemeral range: the kernel's pick, as before
        port = _kernel_pick(host)
        if port not in out:
            out.append(port)
    return out

"""Ports reserved for a process that binds them later (vLLM's KV-event publisher binds inside the engine).

Why a reservation: a port found free by binding and closing a socket is free for everyone again at
once, so replicas starting together on one node could pick the same port before either publisher binds
it. A reservation keeps each port bound (SO_REUSEADDR, never listening) until the engine has bound it
itself, so the kernel hands it to no other caller in the meantime.
"""

from __future__ import annotations

import socket


class PortReservation:
    """`n` distinct free TCP ports, held until the `with` block (or `release()`) ends."""

    def __init__(self, n: int, host: str = ""):
        self._socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the real server may bind it meanwhile
            s.bind((host, 0))
            self._socks.append(s)
        self.ports = [s.getsockname()[1] for s in self._socks]

    def release(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

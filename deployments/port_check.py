"""Before a local run binds its HTTP port: say at once who holds it when it is taken.

Why a check before start-up: Serve's HTTP front binds the port minutes after `kvmesh serve` starts (after
Ray and the engines), and a port held by a leftover HAProxy keeps answering with HTTP 500, so a server
started behind it looks alive but is not. Failing first, naming the holder, points at the real cause.
"""

from __future__ import annotations

import errno
import socket


def port_holder(port: int) -> str:
    """'pid N (name)' of the process listening on `port`, or a vaguer phrase when it cannot be seen."""
    import psutil

    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error:
        return "another process (not visible to this user)"
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN:
            if c.pid is None:
                return "another process (not visible to this user)"
            try:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
            except psutil.Error:
                return f"pid {c.pid}"
    return "another process"


def check_port_free(host: str, port: int) -> None:
    """Raise OSError naming the port and its holder when `host:port` cannot be bound now."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no holder
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from None
            raise OSError(exc.errno, f"port {port} on {host} is already in use by {port_holder(port)}") from None

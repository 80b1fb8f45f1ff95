"""Entry point of kvmesh's LMCache servers: LMCache's own server, reachable only through its private folder.

Why: LMCache 0.5.6 binds its request socket to `tcp://<--host>:<--port>` without authentication, and its
engine-driven transfer path unpickles what a client sends, so any local user who could connect could run
code as kvmesh's user and read or clear every tenant's KV; its Prometheus exporter
(`prometheus_client.start_http_server(port)`) binds every interface. kvmesh gives the server an ipc://
`--host` inside a 0700 folder (kvstore/lmcache_server.py makes it), and this entry point, inside the server
process, before LMCache runs:
- binds the ZMQ request server to that ipc endpoint; a bind URL that is not ipc stops the server rather than
  listen on TCP (a later LMCache that builds it differently fails closed);
- serves the Prometheus metrics on a unix socket in the same folder (`tiers.metrics_socket_path`);
- takes a non-resp L2 adapter's JSON, which may hold credentials, from the environment
  (`tiers.L2_ADAPTER_ENV`) into `--l2-adapter`: the command line is what `ps` shows every local user;
- makes what the server writes (an fs shared tier's chunk files) private to kvmesh's user (umask 077);
- removes its sockets and their folder when it ends after its owner died (nobody else would).

    python -m kvmesh.kvstore.lmcache_main [LMCache server arguments]
"""

from __future__ import annotations

import os
import runpy
import socketserver
import stat
import sys
import threading

from kvmesh.kvstore.private_dir import OWNER_TAG_FILE
from kvmesh.kvstore.tiers import L2_ADAPTER_ENV, metrics_socket_path

SERVER_MODULE = "lmcache.v1.multiprocess.server"
PRIVATE_UMASK = 0o077


def host_argument(argv: list[str], default: str = "localhost") -> str:
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--host="):
            return arg.split("=", 1)[1]
    return default


def ipc_bind_url(bind_url: str) -> str:
    """The endpoint to bind for the URL LMCache built (`tcp://` + --host + `:` + --port): the ipc one inside it.

    Raises SystemExit for any other: the server must never listen on TCP."""
    inner = bind_url.removeprefix("tcp://")
    if not inner.startswith("ipc://"):
        raise SystemExit(f"kvmesh's LMCache server binds only ipc:// endpoints, not {bind_url!r}")
    return inner


def bind_requests_to_ipc_only() -> None:
    """LMCache's ZMQ request server, bound where `ipc_bind_url` says."""
    from lmcache.v1.multiprocess.transport.zmq_impl import server as zmq_server

    base = zmq_server.MessageQueueServer

    class IpcOnlyMessageQueueServer(base):  # type: ignore[misc, valid-type]
        def __init__(self, bind_url: str, context) -> None:
            super().__init__(ipc_bind_url(bind_url), context)

    zmq_server.MessageQueueServer = IpcOnlyMessageQueueServer


class _UnixMetricsServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def start_unix_metrics_server(path: str, registry) -> tuple[socketserver.BaseServer, threading.Thread]:
    """Serve `registry` as Prometheus text over HTTP on the unix socket `path` (what `start_http_server` does
    on a TCP port); a socket left by a killed server is replaced."""
    from prometheus_client.exposition import MetricsHandler

    class LocalMetricsHandler(MetricsHandler.factory(registry)):  # type: ignore[misc]
        def address_string(self) -> str:  # a unix peer has no address (BaseHTTPRequestHandler indexes it)
            return "local"

        def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's parameter name)
            pass

    if os.path.lexists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
        os.unlink(path)
    server = _UnixMetricsServer(path, LocalMetricsHandler)
    thread = threading.Thread(target=server.serve_forever, name="kvmesh-lmcache-metrics", daemon=True)
    thread.start()
    return server, thread


def serve_metrics_on_unix_socket(path: str) -> None:
    """LMCache's `prometheus_client.start_http_server(port)`, served on the unix socket `path` instead."""
    import prometheus_client

    def start_http_server(port: int = 0, addr: str = "", registry=prometheus_client.REGISTRY, **_tls):
        return start_unix_metrics_server(path, registry)

    # the same call, another server type: LMCache ignores what it returns
    prometheus_client.start_http_server = start_http_server  # type: ignore[assignment]


def adapter_from_environment(environ=os.environ) -> list[str]:
    """`--l2-adapter JSON` for the adapter the environment carries ([] when none); the variable is removed so
    that nothing the server starts inherits it."""
    adapter = environ.pop(L2_ADAPTER_ENV, None)
    return ["--l2-adapter", adapter] if adapter else []


def remove_channel_if_orphaned(host: str, owner: int) -> None:
    """The server's sockets and their folder, removed when its owner (`owner`, the pid of the parent it was
    started by) is gone: an owner killed outright removes nothing, and its parent-death signal is what ended
    this server. A server its living owner stopped or restarts keeps them (a restart keeps the endpoint). The
    folder's owner tag (`private_dir.OWNER_TAG_FILE`) goes with them; anything else in it keeps the folder."""
    if os.getppid() == owner:
        return
    folder = os.path.dirname(host.removeprefix("ipc://"))
    try:  # the owner's own exit may have removed them first
        for entry in os.scandir(folder):
            if entry.name == OWNER_TAG_FILE or stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.unlink(entry.path)
        os.rmdir(folder)  # only when nothing but the sockets and the tag was in it
    except OSError:
        pass


def main() -> None:
    owner = os.getppid()
    os.umask(PRIVATE_UMASK)
    sys.argv += adapter_from_environment()
    host = host_argument(sys.argv[1:])
    serve_metrics_on_unix_socket(metrics_socket_path(host))
    bind_requests_to_ipc_only()
    try:
        runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
    finally:
        remove_channel_if_orphaned(host, owner)


if __name__ == "__main__":
    main()

"""Entry point of kvmesh's LMCache servers: LMCache's own server, with its metrics port on the server's host.

Why: LMCache 0.5.6 starts its Prometheus exporter with `prometheus_client.start_http_server(port)`, which
binds every interface, while the request port honours `--host`. Binding the exporter to the same host
keeps a server started on 127.0.0.1 unreachable from other machines; the server is unchanged otherwise.

    python -m kvmesh.kvstore.lmcache_main [LMCache server arguments]
"""

from __future__ import annotations

import functools
import runpy
import sys

SERVER_MODULE = "lmcache.v1.multiprocess.server"


def host_argument(argv: list[str], default: str = "localhost") -> str:
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--host="):
            return arg.split("=", 1)[1]
    return default


def main() -> None:
    import prometheus_client

    prometheus_client.start_http_server = functools.partial(
        prometheus_client.start_http_server, addr=host_argument(sys.argv[1:])
    )
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

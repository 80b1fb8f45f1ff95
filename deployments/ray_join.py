"""Join a Ray cluster someone else started (`kvmesh serve --address`, KubeRay's head, `ray start`).

Joining passes no CPUs, GPUs or environment: the cluster's nodes keep what their operator gave them,
and the app's deployments carry their own runtime env. One trap is handled here: a cluster whose nodes
run on 127.0.0.1 (several nodes on one machine, `ray start --node-ip-address 127.0.0.1`). Ray 2.60
rewrites a loopback address to the host's routable one (`services.resolve_ip_for_localhost`), both the
GCS address a driver or node joins and the node's own address, while the servers of such a cluster
listen on 127.0.0.1 only: the join then times out. For loopback addresses that rewrite is bypassed
during the call (deployments/local_ray.py does the same for the cluster kvmesh starts itself); the
private names involved live in deployments/ray_private.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvmesh.deployments import ray_private

LOOPBACK = "127.0.0.1"
REACH_TIMEOUT_S = 5.0  # a GCS that is up accepts a connection at once; a dropped packet costs this much


class ClusterUnreachable(ConnectionError):
    """Nothing accepts a connection at the Ray cluster address given."""


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise ClusterUnreachable unless something accepts a TCP connection at `address` (host:port of a
    cluster's GCS) within `timeout_s`. Why: `ray.init` retries a GCS it cannot reach 20 times, each try
    waiting about 40 s and printing warnings, so a wrong or dead address failed only after some 14 minutes."""
    import socket

    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")  # an IPv6 address in brackets
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536:
        raise ClusterUnreachable(f"Ray cluster address {address!r}: expected host:port, port 1-65535")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except TimeoutError:
        raise ClusterUnreachable(f"no Ray cluster answers at {address}: no connection within {timeout_s:g}s") from None
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ClusterUnreachable(f"no Ray cluster answers at {address}: {why}") from None


def address_is_here(address: str) -> bool:
    """Whether the cluster at `address` (host:port of its GCS) can have no node but this machine: its host
    resolves to loopback addresses only (a node elsewhere could not reach that GCS), so a file here is a
    file on every node. An address that does not resolve is taken as elsewhere."""
    import ipaddress
    import socket

    host = address.rpartition(":")[0].strip("[]")
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(str(a[4][0]).split("%")[0]).is_loopback for a in found)


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in (LOOPBACK, "localhost")


@contextlib.contextmanager
def keep_loopback() -> Iterator[None]:
    """While inside, Ray keeps 127.0.0.1 as it is instead of rewriting it to the host's address."""

    def make(resolve):
        def keep(host: str) -> str:
            return LOOPBACK if host in (LOOPBACK, "localhost") else resolve(host)

        return keep

    with ray_private.localhost_resolver(make):
        yield


def join_cluster(address: str, *, log_to_driver: bool = False) -> None:
    """Connect this process to the running cluster at `address` (host:port of its GCS) as a driver; an
    address nothing answers at raises ClusterUnreachable at once (`check_reachable`)."""
    import ray

    check_reachable(address)
    if not is_loopback(address):
        ray.init(address=address, include_dashboard=False, log_to_driver=log_to_driver)
        return
    with keep_loopback():
        ray.init(
            address=f"{LOOPBACK}:{address.rsplit(':', 1)[1]}",
            include_dashboard=False,
            log_to_driver=log_to_driver,
            **ray_private.node_ip_init_kwargs(LOOPBACK),
        )

"""Serve's replica-to-replica gRPC servers on loopback when the whole cluster is this machine's loopback.

Why: Ray Serve 2.60 starts every replica's inter-deployment gRPC server on "[::]:0", every interface, with
no setting to change it. A local kvmesh run pins its Ray node to 127.0.0.1 (deployments/local_ray.py),
so no peer can be elsewhere and the port must not be reachable from elsewhere either. Each replica calls
`bind_replica_grpc_to_loopback()` in its constructor, which Serve runs before it starts that server. On a
node with a routable address (KubeRay) nothing changes. Serve's module-level name is private
(deployments/ray_private.py): if it is missing (another Ray), the replica logs it and keeps Serve's binding.
"""

from __future__ import annotations

import logging

from kvmesh.deployments import ray_private

log = logging.getLogger("ray.serve.kvmesh")

LOOPBACK = "127.0.0.1"
_MARK = "_kvmesh_loopback"


def bind_replica_grpc_to_loopback() -> bool:
    """Make this replica process bind Serve's gRPC server on 127.0.0.1; True when it now does."""
    import ray

    if not ray.is_initialized() or ray.util.get_node_ip_address() != LOOPBACK:
        return False
    try:
        add_port = ray_private.replica_grpc_add_port()
    except ImportError:
        return False
    if add_port is None:
        log.warning("this Ray Serve has no replica.add_port_to_grpc_server: its gRPC server binds Serve's default")
        return False
    if getattr(add_port, _MARK, False):
        return True

    def add_port_on_loopback(server, address):
        return add_port(server, f"{LOOPBACK}:0" if address == "[::]:0" else address)

    setattr(add_port_on_loopback, _MARK, True)
    ray_private.set_replica_grpc_add_port(add_port_on_loopback)
    return True

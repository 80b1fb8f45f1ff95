"""Placement policies: (request blocks, per-replica views) -> replicas ranked best first. Ranking is
pure; a policy's state changes only in its lifecycle hooks (policies/base.py).

The same policy objects run in the live Ray Serve router (deployments/router.py) and in the trace
simulator (cluster/simulator.py). Nothing in this package does I/O or knows who calls it.
"""

from kvmesh.policies.base import TIERS, Policy, ReplicaView, RequestInfo

__all__ = ["Policy", "ReplicaView", "RequestInfo", "TIERS", "make_policy", "POLICY_NAMES"]


def __getattr__(name):  # lazy, so importing the interface does not import every policy
    if name in ("make_policy", "POLICY_NAMES"):
        from kvmesh.policies import registry

        return getattr(registry, name)
    raise AttributeError(name)

"""What policy unit tests share: idle replica views with a few fields set per replica."""

from __future__ import annotations

from kvmesh.policies.base import ReplicaView


def views(k, **per):
    """k idle replicas; `per` maps field -> {index: value}."""
    out = [ReplicaView(f"r{i}", capacity_blocks=1000) for i in range(k)]
    for field, values in per.items():
        for i, v in values.items():
            setattr(out[i], field, v)
    return out

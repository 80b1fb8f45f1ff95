"""Policy names -> classes, so the CLI, the simulator and the live router build policies the same way."""

from __future__ import annotations

from kvmesh.policies.base import Policy
from kvmesh.policies.baselines import ConsistentHash, LeastLoaded, PowerOfTwo, RandomChoice, RoundRobin
from kvmesh.policies.dynamo_cost import DynamoCost
from kvmesh.policies.kvmesh import KvmeshPolicy
from kvmesh.policies.llmd_precise import LlmdPrecise
from kvmesh.policies.ray_prefix_affinity import RayPrefixAffinity
from kvmesh.policies.sglang_cache_aware import SglangCacheAware

_CLASSES: dict[str, type[Policy]] = {
    c.name: c
    for c in (
        KvmeshPolicy,
        RoundRobin,
        RandomChoice,
        LeastLoaded,
        PowerOfTwo,
        ConsistentHash,
        SglangCacheAware,
        RayPrefixAffinity,
        LlmdPrecise,
        DynamoCost,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(_CLASSES)
BASELINES = ("round_robin", "random", "least_loaded", "power_of_two", "consistent_hash")
PEERS = ("sglang_cache_aware", "ray_prefix_affinity", "llmd_precise", "dynamo_cost")


def make_policy(name: str, seed: int = 0, **params) -> Policy:
    """A fresh policy instance; unknown names raise ValueError listing the known ones."""
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return cls(seed=seed, **params)


def parse_policy_list(text: str) -> list[str]:
    """'a,b' or 'all' -> validated names in order (ValueError on unknown or empty)."""
    if text.strip() == "all":
        return list(POLICY_NAMES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("no policy given")
    for n in names:
        if n not in _CLASSES:
            raise ValueError(f"unknown policy {n!r}; known: {', '.join(POLICY_NAMES)}, or 'all'")
    return list(dict.fromkeys(names))

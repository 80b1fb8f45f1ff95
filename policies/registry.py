"""Policy names -> classes, so the CLI, the simulator and the live router build policies the same way."""

from __future__ import annotations

import inspect

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
    """A fresh policy instance; unknown names and parameters raise ValueError listing the known ones (a
    misspelt parameter in a config would otherwise be taken and ignored)."""
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    known = policy_parameters(cls)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"policy {name}: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known)) or 'none'}"
        )
    return cls(seed=seed, **params)


def policy_parameters(cls: type[Policy]) -> set[str]:
    """The keyword parameters `cls`'s constructor names, through the constructors it passes `**params` on
    to (seed aside)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        sig = inspect.signature(init)
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names |= {p.name for p in sig.parameters.values() if p.kind in kinds}
        if klass is Policy or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            break
    return names - {"self", "seed"}


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

"""The isolation tests' own helpers (tests/support/isolation_support.py): the Mann-Whitney U statistic and
the salts of the isolation cases."""

from __future__ import annotations

import itertools

import pytest
from isolation_support import (
    EngineRunner,
    build_prefill_heavy_model,
    mann_whitney_u,
    set_engine_env,
)

from kvmesh.deployments.tenants import TenantRegistry, hash_api_key

SECRET = b"isolation-test-secret-0123456789"
TENANTS = {  # id -> sharing group
    "t0": None,
    "t1": None,
    "t2": None,
    "t3": None,
    "docs-a": "public-docs",
    "docs-b": "public-docs",
}


def make_registry() -> TenantRegistry:
    return TenantRegistry.from_dict(
        {
            "tenants": [
                {"id": tid, **({"group": g} if g else {}), "keys": [{"sha256": hash_api_key(f"kvm-key-for-{tid}-xyz")}]}
                for tid, g in TENANTS.items()
            ]
        },
        secret=SECRET,
    )


REGISTRY = make_registry()
SALTS = {tid: t.salt for tid, t in REGISTRY.tenants.items()}


# --- pure helpers (no engine) -----------------------------------------------------------------------


def test_mann_whitney_u_helper():
    same = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    assert mann_whitney_u(same, list(same))[1] == pytest.approx(1.0)
    low, high = [i / 100 for i in range(20)], [1 + i / 100 for i in range(20)]
    assert mann_whitney_u(low, high)[0] == 0 and mann_whitney_u(low, high)[1] < 1e-6
    assert mann_whitney_u(low, high, "less")[1] < 1e-6
    assert mann_whitney_u(high, low, "less")[1] > 0.999
    # textbook value: x=1..3 vs 4..6, normal approximation z=-1.964 -> two-sided p=0.0495
    assert mann_whitney_u([1, 2, 3], [4, 5, 6])[1] == pytest.approx(0.0495, abs=1e-3)


def test_registry_salts_for_the_isolation_cases():
    assert SALTS["docs-a"] == SALTS["docs-b"]
    assert len({SALTS[t] for t in ("t0", "t1", "t2", "t3", "docs-a")}) == 5


# --- real engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("h5-isolation")
    set_engine_env(root)
    model = build_prefill_heavy_model(root / "heavy")
    runner = EngineRunner(model)
    yield runner
    runner.shutdown()


_nonce = itertools.count(1)

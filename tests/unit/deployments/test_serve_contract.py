"""The start-up check of what kvmesh's router needs from Ray Serve: clean on the pinned Ray, and a clear
failure naming the difference when Ray differs (a version outside the range, a changed PendingRequest)."""

from __future__ import annotations

import dataclasses

import pytest
import ray
import ray.serve.request_router as public

from kvmesh.deployments.serve_contract import ServeContractError, check_serve_contract, contract_problems


def test_the_installed_ray_fits():
    assert contract_problems() == []
    check_serve_contract()


def test_a_ray_outside_the_supported_range_fails_the_deploy(monkeypatch):
    import kvmesh.deployments.serve_contract as contract

    monkeypatch.setattr(contract, "_checked", False)
    monkeypatch.setattr(ray, "__version__", "2.61.0")
    with pytest.raises(ServeContractError, match=r"ray 2\.61\.0 is outside the supported range >=2\.60,<2\.61"):
        check_serve_contract()


def test_a_pending_request_without_its_future_is_named(monkeypatch):
    @dataclasses.dataclass
    class NoFuture:
        args: list
        metadata: object

        def reset_future(self):
            pass

    monkeypatch.setattr(public, "PendingRequest", NoFuture)
    assert contract_problems() == ["PendingRequest has no field 'future'"]


def test_a_reset_that_keeps_the_old_future_is_named(monkeypatch):
    real = public.PendingRequest

    @dataclasses.dataclass
    class StickyFuture(real):  # type: ignore[valid-type,misc]
        def reset_future(self):
            pass

    monkeypatch.setattr(public, "PendingRequest", StickyFuture)
    assert contract_problems() == ["PendingRequest.reset_future does not give the request a new future"]


def test_pyproject_pins_the_platform_ray_inside_the_supported_range():
    """Both extras pin ray[serve] to exactly the release the platform runs (2.60.0), and that release is
    inside the range the start-up check accepts."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version
    from paths import REPO_ROOT

    from kvmesh.deployments.serve_contract import SUPPORTED_RAY

    platform = Version("2.60.0")
    low, high = SUPPORTED_RAY
    assert low <= (platform.major, platform.minor) < high
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("cpu", "gpu"):
        ray_req = next(Requirement(r) for r in extras[extra] if Requirement(r).name == "ray")
        assert ray_req.extras == {"serve"}
        assert str(ray_req.specifier) == f"=={platform}", extra


def test_a_handle_without_broadcast_is_named(monkeypatch):
    from ray.serve.handle import DeploymentHandle

    monkeypatch.delattr(DeploymentHandle, "broadcast")
    assert contract_problems() == ["DeploymentHandle.broadcast is missing"]

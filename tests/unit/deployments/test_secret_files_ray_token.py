"""The Ray token of a local run (deployments/local_ray.py): Ray would write one to ~/.ray/auth_token
readable by every local user; kvmesh writes its own to an owner-only file, names it in
RAY_AUTH_TOKEN_PATH, and removes it at the end, unless the operator chose a token or turned
authentication off. Nothing starts Ray here (tests/integration/test_local_cluster_orphans.py does)."""

from __future__ import annotations

import os
import stat

import pytest

from kvmesh.deployments import local_ray

AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A user with no Ray token anywhere; the variables set by a test are removed after it."""
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "kvmesh"))
    for name in AUTH_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return tmp_path


def test_a_local_run_gets_an_owner_only_token_removed_at_its_end(user):
    path = local_ray.use_private_auth_token()
    assert path and path.startswith(str(user / "kvmesh" / "run"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == path and len(open(path).read()) == 64
    assert not local_ray.ray_default_token_path().exists()  # Ray has no reason to write its own
    assert local_ray.use_private_auth_token() is None  # a second start of the run keeps it
    local_ray.remove_auth_token_file()
    assert not os.path.exists(path) and "RAY_AUTH_TOKEN_PATH" not in os.environ


@pytest.mark.parametrize(
    "configured",
    [{"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN": "an-operators-token"}, {"RAY_AUTH_TOKEN_PATH": "/x/token"}],
)
def test_an_operators_choice_is_left_alone(user, monkeypatch, configured):
    for name, value in configured.items():
        monkeypatch.setenv(name, value)
    assert local_ray.use_private_auth_token() is None
    assert os.environ.get("RAY_AUTH_TOKEN_PATH", "") == configured.get("RAY_AUTH_TOKEN_PATH", "")


def test_a_token_the_user_already_has_is_left_alone(user):
    default = local_ray.ray_default_token_path()
    default.parent.mkdir(parents=True)
    default.write_text("the-users-own-token")
    default.chmod(0o600)
    assert local_ray.use_private_auth_token() is None and "RAY_AUTH_TOKEN_PATH" not in os.environ


def test_the_token_ray_left_readable_by_everyone_is_not_kept(user):
    """Ray writes ~/.ray/auth_token 0644 when it makes one itself: a machine where Ray ran before would
    otherwise keep a token every local user can read."""
    default = local_ray.ray_default_token_path()
    default.parent.mkdir(parents=True)
    default.write_text("a-token-ray-wrote")
    default.chmod(0o644)
    path = local_ray.use_private_auth_token()
    assert path and os.environ["RAY_AUTH_TOKEN_PATH"] == path
    local_ray.remove_auth_token_file()

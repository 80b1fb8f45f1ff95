"""The secret files a local run writes for itself (its KV-event channel secret, a per-run copy of
KVMESH_SALT_SECRET) are removed when it stops, whichever way it stops: an orderly stop, a start that failed
half-way, or `kvmesh serve`'s fast stop after its relay died. The salt secret kept under KVMESH_HOME stays
(later runs reuse it), and a salt secret that is the published examples' placeholder is refused. Ray and
Serve are faked: nothing starts."""

from __future__ import annotations

import os
import stat

import pytest

from kvmesh.deployments.config import ConfigError

EXPLICIT = "an-operator-salt-secret-0123456789"
PLACEHOLDER = "REPLACE-WITH-32-RANDOM-BYTES-HEX"  # k8s/secrets.example.yaml


def _secret_files(home) -> list[str]:
    run = home / "run"
    return sorted(p.name for p in run.iterdir()) if run.exists() else []


def _start(config: dict | None = None) -> str:
    from kvmesh.deployments.app import start_local

    return start_local({"replicas": 1, "port": 0, "proxy": "serve", **(config or {})})


def test_an_orderly_stop_removes_the_runs_secret_files_and_keeps_the_kept_salt(home, fake_ray):
    from kvmesh.deployments.app import stop_local

    _start()
    channel = os.environ["KVMESH_CHANNEL_SECRET_FILE"]
    assert os.path.exists(channel) and stat.S_IMODE(os.stat(channel).st_mode) == 0o600
    kept = home / "salt-secret"
    assert os.environ["KVMESH_SALT_SECRET_FILE"] == str(kept)
    stop_local(drain=False)
    assert _secret_files(home) == [], "the run's channel secret outlived it"
    assert "KVMESH_CHANNEL_SECRET_FILE" not in os.environ
    assert kept.exists()  # the kept salt secret is for later runs


def test_a_per_run_salt_secret_file_is_removed_and_its_value_handed_back(home, fake_ray, monkeypatch):
    from kvmesh.deployments.app import stop_local

    monkeypatch.setenv("KVMESH_SALT_SECRET", EXPLICIT)
    _start()
    per_run = os.environ["KVMESH_SALT_SECRET_FILE"]
    assert open(per_run).read() == EXPLICIT and "KVMESH_SALT_SECRET" not in os.environ  # not seen by Ray
    stop_local(drain=False)
    assert _secret_files(home) == [] and not (home / "salt-secret").exists()
    # a later start in this process derives the same salts again
    assert os.environ.get("KVMESH_SALT_SECRET") == EXPLICIT and "KVMESH_SALT_SECRET_FILE" not in os.environ


def test_a_start_that_failed_half_way_leaves_no_secret_file(home, fake_ray, monkeypatch):
    def proxy_killed(**kw):
        raise RuntimeError("The actor died unexpectedly before finishing this task")

    fake_ray["serve_start"] = proxy_killed
    monkeypatch.setenv("KVMESH_SALT_SECRET", EXPLICIT)
    with pytest.raises(RuntimeError, match="actor died"):
        _start()
    assert _secret_files(home) == []


def test_a_start_that_failed_before_ray_ran_leaves_no_secret_file_and_hands_the_salt_back(home, fake_ray, monkeypatch):
    from kvmesh.deployments import local_ray

    def no_ray(**kw):
        raise RuntimeError("ray did not start")

    monkeypatch.setattr(local_ray, "start_local_ray", no_ray)
    monkeypatch.setenv("KVMESH_SALT_SECRET", EXPLICIT)
    with pytest.raises(RuntimeError, match="did not start"):
        _start()
    assert _secret_files(home) == []
    assert os.environ.get("KVMESH_SALT_SECRET") == EXPLICIT and "KVMESH_CHANNEL_SECRET_FILE" not in os.environ


def test_the_fast_stop_after_the_relay_died_removes_the_secret_files(home, fake_ray, monkeypatch, relay_gone):
    """`kvmesh serve`'s driver on SIGHUP (its relay was killed): it ends its processes and exits at once."""
    import argparse

    serve_cmd = relay_gone
    monkeypatch.setenv("KVMESH_SALT_SECRET", EXPLICIT)
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    args = parser.parse_args(["--port", "0", "--proxy", "serve"])
    with pytest.raises(SystemExit):
        serve_cmd._drive(args, serve_cmd._build_config(args))
    assert _secret_files(home) == []


def test_the_published_placeholder_is_refused_as_a_salt_secret(home, fake_ray, monkeypatch, tmp_path):
    from kvmesh.deployments.salt_secret import persistent_secret_file

    with pytest.raises(ConfigError, match=r"salt secret \(KVMESH_SALT_SECRET\) is the example's placeholder"):
        persistent_secret_file(PLACEHOLDER)
    monkeypatch.setenv("KVMESH_SALT_SECRET", PLACEHOLDER)
    with pytest.raises(ConfigError, match="placeholder"):
        _start()
    assert _secret_files(home) == []  # refused before anything was written
    monkeypatch.delenv("KVMESH_SALT_SECRET")
    mounted = tmp_path / "mounted-secret"
    mounted.write_text(PLACEHOLDER + "\n")  # as a Kubernetes Secret made from the example holds it
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", str(mounted))
    with pytest.raises(ConfigError, match=r"KVMESH_SALT_SECRET_FILE '[^']*'\) is the example's placeholder"):
        _start()


def test_a_salt_secret_too_short_for_the_replicas_is_refused_before_ray_starts(home, fake_ray, monkeypatch):
    """The replicas' own check (tenants.check_secret: the placeholder and the length), made before Ray runs, as
    `kvmesh serve` makes it: a short secret does not get as far as a replica that then refuses it."""
    fake_ray["on_ray_start"] = lambda: pytest.fail("Ray was started")
    monkeypatch.setenv("KVMESH_SALT_SECRET", "too-short")
    with pytest.raises(ConfigError, match=r"salt secret from KVMESH_SALT_SECRET is too short"):
        _start()
    assert _secret_files(home) == []  # refused before anything was written
    assert os.environ.get("KVMESH_SALT_SECRET") == "too-short"  # the environment as it was


def test_a_short_salt_secret_file_is_refused_before_ray_starts(home, fake_ray, monkeypatch, tmp_path):
    """The same check of the file KVMESH_SALT_SECRET_FILE names, read as the replicas read it (stripped)."""
    fake_ray["on_ray_start"] = lambda: pytest.fail("Ray was started")
    short = tmp_path / "short-secret"
    short.write_text("too-short\n")
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", str(short))
    with pytest.raises(ConfigError, match=r"salt secret from KVMESH_SALT_SECRET_FILE '[^']*' is too short"):
        _start()
    assert not fake_ray["up"] and _secret_files(home) == []


def test_kvmesh_serve_refuses_the_placeholder_in_one_line_before_starting(home, monkeypatch, capsys):
    from kvmesh.deployments import supervisor
    from kvmesh.deployments.cli import main

    monkeypatch.setattr(supervisor, "supervise", lambda argv: pytest.fail("the driver was started"))
    monkeypatch.setenv("KVMESH_SALT_SECRET", PLACEHOLDER)
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "placeholder" in err and PLACEHOLDER not in err, err


def test_a_secret_file_this_machine_cannot_read_is_left_to_the_cluster_this_process_already_runs_in(
    home, fake_ray, monkeypatch, tmp_path
):
    """Deployed from a process already connected to a Ray cluster, the file KVMESH_SALT_SECRET_FILE names may be
    on the cluster's nodes only: the pre-start check leaves an unreadable one to the replicas there, as it does
    for a cluster joined by address. Started here, the same file is refused before Ray starts."""
    from kvmesh.deployments.app import stop_local

    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", str(tmp_path / "only-on-the-nodes"))
    with pytest.raises(ConfigError, match="cannot read salt secret file"):
        _start()
    fake_ray["up"] = True  # connected already: the cluster's nodes hold the file
    try:
        _start()
    finally:
        stop_local()

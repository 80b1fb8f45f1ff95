"""`kvmesh serve` input that was accepted and then failed, or was dropped, once Ray ran: a salt secret the
replicas refuse, flags one of which was ignored, values given as empty strings. Each stops before the launch,
as one line with exit status 2. Nothing starts: the launch is a stub that records it was reached."""

from __future__ import annotations

import pytest
from cli_checks import refused_naming as refused
from cli_checks import serve_launches

from kvmesh.deployments.cli import main

GOOD_SECRET = "an-operator-salt-secret-0123456789"


@pytest.fixture
def launch(home, monkeypatch):
    """`kvmesh serve` up to its launch (no salt secret configured, a private KVMESH_HOME): the launches
    reached, none when the input is refused."""
    return serve_launches(monkeypatch)


# ------------------------------------------------------------------------------------------ salt secret


@pytest.mark.parametrize(
    "variable, value, needle",
    [
        ("KVMESH_SALT_SECRET", "short", "salt secret from KVMESH_SALT_SECRET is too short: need at least 16 bytes"),
        ("KVMESH_SALT_SECRET_FILE", "/nonexistent", "cannot read salt secret file '/nonexistent'"),
        ("KVMESH_SALT_SECRET_FILE", "short\n", "salt secret from KVMESH_SALT_SECRET_FILE"),
        ("KVMESH_SALT_SECRET_FILE", "", "is too short"),
        ("KVMESH_SALT_SECRET_FILE", "REPLACE-WITH-32-RANDOM-BYTES-HEX\n", "is the example's placeholder"),
        ("KVMESH_SALT_SECRET_FILE", "dir", "cannot read salt secret file"),
    ],
)
def test_a_salt_secret_the_replicas_would_refuse_stops_before_the_launch(
    variable, value, needle, launch, tmp_path, monkeypatch, capsys
):
    """The length check and the file's read were made only in the replicas, once Ray ran."""
    if variable == "KVMESH_SALT_SECRET_FILE" and value not in ("/nonexistent", "dir"):
        (tmp_path / "secret").write_text(value)
        value = str(tmp_path / "secret")
    elif value == "dir":
        value = str(tmp_path)
    monkeypatch.setenv(variable, value)
    err = refused(["serve", "--port", "0"], capsys, needle)
    assert launch == []
    assert "short" not in err.replace("too short", "") and "REPLACE-WITH" not in err  # the secret is not echoed


def test_the_replicas_refuse_such_a_secret_too(tmp_path):
    """Defence in depth: what the CLI checks, the replicas' own resolve_secret still refuses."""
    from kvmesh.deployments import tenants

    with pytest.raises(tenants.ConfigError, match="too short"):
        tenants.resolve_secret(env={"KVMESH_SALT_SECRET": "short"})
    with pytest.raises(tenants.ConfigError, match="cannot read salt secret file"):
        tenants.resolve_secret(env={"KVMESH_SALT_SECRET_FILE": str(tmp_path / "missing")})


def test_a_good_or_default_salt_secret_reaches_the_launch(launch, tmp_path, monkeypatch):
    assert main(["serve", "--port", "0"]) == 0  # none configured: the run keeps its own (made as it starts)
    monkeypatch.setenv("KVMESH_SALT_SECRET", GOOD_SECRET)
    assert main(["serve", "--port", "0"]) == 0
    monkeypatch.delenv("KVMESH_SALT_SECRET")
    (tmp_path / "secret").write_text(GOOD_SECRET + "\n")
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", str(tmp_path / "secret"))
    assert main(["serve", "--port", "0"]) == 0
    assert len(launch) == 3


def test_the_secret_variable_wins_over_the_file_as_in_the_replicas_and_is_checked_stripped(
    launch, tmp_path, monkeypatch, capsys
):
    """The replicas read the file only without the variable: a good variable beside a missing file starts (it
    was refused); a variable short once its blanks are dropped is refused (a local run hands it over in a file,
    read stripped, so the replicas would refuse it after the start)."""
    monkeypatch.setenv("KVMESH_SALT_SECRET", GOOD_SECRET)
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", str(tmp_path / "missing"))
    assert main(["serve", "--port", "0"]) == 0 and len(launch) == 1
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE")
    monkeypatch.setenv("KVMESH_SALT_SECRET", "abcdefghijklmno ")  # 16 characters, 15 once stripped
    refused(["serve", "--port", "0"], capsys, "too short")
    assert len(launch) == 1


def test_a_secret_file_of_a_joined_clusters_nodes_is_theirs_to_check(launch, monkeypatch, capsys):
    """With --address the file may exist only on the cluster's nodes; a secret in the variable is checked."""
    from kvmesh.deployments import ray_join

    monkeypatch.setattr(ray_join, "check_reachable", lambda address: None)  # no cluster needed for this check
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", "/run/secrets/on-the-nodes-only")
    assert main(["serve", "--address", "10.0.0.1:6379"]) == 0 and len(launch) == 1
    monkeypatch.setenv("KVMESH_SALT_SECRET", "short")
    refused(["serve", "--address", "10.0.0.1:6379"], capsys, "too short")
    assert len(launch) == 1


def test_a_secret_variable_alone_stops_a_join_to_nodes_elsewhere_not_to_this_machine(launch, monkeypatch, capsys):
    """KVMESH_SALT_SECRET reaches the replicas as a file written here (never as a value: Ray logs runtime
    environments), which nodes elsewhere do not have: their replicas failed reading it once Ray ran. Refused
    before the launch, naming what to set instead; a cluster at a loopback address is this machine's."""
    from kvmesh.deployments import ray_join

    monkeypatch.setattr(ray_join, "check_reachable", lambda address: None)  # no cluster needed for this check
    monkeypatch.setenv("KVMESH_SALT_SECRET", GOOD_SECRET)
    err = refused(["serve", "--address", "10.0.0.1:6379"], capsys, "has nodes elsewhere")
    assert "KVMESH_SALT_SECRET_FILE" in err and GOOD_SECRET not in err
    assert launch == []
    assert main(["serve", "--address", "127.0.0.1:6379"]) == 0 and len(launch) == 1
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", "/run/secrets/on-the-nodes-only")  # what the nodes read
    assert main(["serve", "--address", "10.0.0.1:6379"]) == 0 and len(launch) == 2


def test_an_address_nothing_answers_at_stops_before_the_launch(launch, capsys, monkeypatch):
    """`ray.init` retried a GCS it could not reach for some 14 minutes, printing warnings, before it failed:
    an address where nothing accepts a connection is one line naming it, exit 2, before anything starts."""
    import socket

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there now: the connection is refused at once
    try:
        err = refused(["serve", "--address", dead], capsys, f"no Ray cluster answers at {dead}")
        assert "refused" in err.lower() and launch == []
        refused(["serve", "--address", "127.0.0.1:0"], capsys, "port 1-65535")
        assert launch == []
        assert main(["serve", "--address", f"127.0.0.1:{listening.getsockname()[1]}"]) == 0 and len(launch) == 1
        # the driver's join (and any other caller's) checks it too, before ray.init
        import ray

        from kvmesh.deployments import ray_join

        inits = []
        monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
        with pytest.raises(ray_join.ClusterUnreachable, match=f"no Ray cluster answers at {dead}"):
            ray_join.join_cluster(dead)
        assert inits == []
    finally:
        listening.close()


# ---------------------------------------------------------------------------------------- flags


def test_replicas_and_autoscaling_together_are_refused_not_one_dropped(launch, tmp_path, capsys):
    """`--autoscaling 1:2 --replicas 3` ran 1-2 replicas: --replicas was dropped without a word."""
    refused(["serve", "--port", "0", "--autoscaling", "1:2", "--replicas", "3"], capsys, "exclude each other")
    config = tmp_path / "c.yaml"
    config.write_text("autoscaling: {min_replicas: 1, max_replicas: 2}\n")
    refused(["serve", "--port", "0", "--config", str(config), "--replicas", "3"], capsys, "config.autoscaling")
    assert launch == []
    assert (
        main(["serve", "--port", "0", "--config", str(config), "--autoscaling", "1:3"]) == 0
    )  # a flag over the config


@pytest.mark.parametrize("flag", ["--config", "--api-key", "--api-key-file", "--tenants", "--model", "--policy"])
def test_an_explicitly_empty_value_is_refused_not_taken_for_no_value(flag, launch, capsys):
    """`--config ""` ran the default config; `--api-key ""` a generated key; `--model ""` the current folder."""
    refused(["serve", "--port", "0", flag, ""], capsys, f"argument {flag}: expected a value, got an empty string")
    assert launch == []

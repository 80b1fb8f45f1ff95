"""The secret files a local run writes for itself (its KV-event channel secret, a per-run copy of
KVMESH_SALT_SECRET) are removed when it stops, whichever way it stops: an orderly stop, a start that failed
half-way, or `kvmesh serve`'s fast stop after its relay died. The salt secret kept under KVMESH_HOME stays
(later runs reuse it), and a salt secret that is the published examples' placeholder is refused. Ray and
Serve are faked: nothing starts."""

from __future__ import annotations

import errno
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


def _tenants_file(folder, secret: str | None) -> str:
    """A tenants file in `folder` naming its salt secret file `salt-secret` (relative: to the tenants file's
    folder), which holds `secret` (None: no such file)."""
    folder.mkdir()
    if secret is not None:
        (folder / "salt-secret").write_text(secret)
    path = folder / "t.yaml"
    path.write_text(f"secret_file: salt-secret\ntenants:\n  - id: acme\n    keys: [{{sha256: {'ab' * 32}}}]\n")
    return str(path)


def test_a_local_run_salts_from_its_tenants_files_secret_file_not_the_kept_secret(home, fake_ray, tmp_path):
    """docs/tenants.md's order: the variables, else the config's `secret_file:`, else (a local run) the kept
    secret. Pointing the replicas at the kept file outranked the config's."""
    from kvmesh.deployments.app import stop_local
    from kvmesh.deployments.tenants import TenantRegistry, derive_salt

    tenants = _tenants_file(tmp_path / "conf", EXPLICIT + "\n")
    _start({"tenants_file": tenants})
    # what the run's ingress replica loads, in the environment the run hands its processes
    assert TenantRegistry.from_file(tenants).tenants["acme"].salt == derive_salt(EXPLICIT.encode(), "acme")
    assert not (home / "salt-secret").exists()  # no kept secret made for a run that does not use it
    stop_local(drain=False)
    assert "KVMESH_SALT_SECRET_FILE" not in os.environ  # a later run in this process chooses afresh


@pytest.mark.parametrize(
    "secret, match",
    [
        ("too-short\n", r"salt secret from secret_file of tenants file \S+ '\S+salt-secret' is too short"),
        (PLACEHOLDER + "\n", "placeholder"),
        (None, r"cannot read salt secret file '\S+salt-secret' \(secret_file of tenants file \S+\)"),
    ],
)
def test_a_tenants_files_secret_file_the_replicas_would_refuse_is_refused_before_ray_starts(
    home, fake_ray, tmp_path, secret, match
):
    fake_ray["on_ray_start"] = lambda: pytest.fail("Ray was started")
    tenants = _tenants_file(tmp_path / "conf", secret)
    with pytest.raises(ConfigError, match=match):
        _start({"tenants_file": tenants})
    assert not fake_ray["up"] and _secret_files(home) == []


@pytest.mark.parametrize("content", ["", "too-short\n"])
def test_a_kept_salt_secret_the_replicas_would_refuse_is_refused_before_ray_starts(home, fake_ray, content):
    """An empty kept file (a run killed as it made it) or a short one (a truncated copy) was handed to every
    replica, which refused it once Ray and Serve ran."""
    fake_ray["on_ray_start"] = lambda: pytest.fail("Ray was started")
    home.mkdir(mode=0o700)
    kept = home / "salt-secret"
    kept.write_text(content)
    kept.chmod(0o600)
    with pytest.raises(ConfigError, match=r"salt secret from the kept file '\S+salt-secret' is too short.*delete it"):
        _start()
    assert not fake_ray["up"] and _secret_files(home) == []


def test_the_kept_salt_secret_gets_its_name_only_whole_and_the_first_one_made_wins(home, monkeypatch):
    """Created in place, the kept file was empty until written: a run killed meanwhile left it so, and a run
    starting meanwhile read it so. Now it is written aside and linked in whole; another run's, linked in
    first, is the one every run uses, and the copy written aside goes."""
    from kvmesh.deployments import salt_secret

    theirs = "another-runs-salt-secret-0123456789abcdef"
    real_link = os.link
    linked = []

    def another_run_first(src, dst):
        linked.append(open(src).read())  # what gets the name: written whole already
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, theirs.encode())
        os.close(fd)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", another_run_first)
    kept = salt_secret.persistent_secret_file()
    assert len(linked) == 1 and len(linked[0]) == 64
    assert kept == home / "salt-secret" and kept.read_text() == theirs
    assert _secret_files(home) == []  # the copy written aside is gone


def _join(fake_ray, monkeypatch) -> None:
    """`--address` joins a cluster whose head node is this machine (the start then polls its own URL)."""
    import ray
    from ray import serve

    from kvmesh.deployments import app, ray_join

    monkeypatch.setattr(ray_join, "join_cluster", lambda address, **kw: fake_ray.__setitem__("up", True))
    monkeypatch.setattr(serve, "delete", lambda name: None)  # the stop deletes the app from a cluster it joined
    monkeypatch.setattr(app, "kill_router_registry", lambda name: None)
    head = {"Alive": True, "NodeManagerAddress": "10.0.0.5", "Resources": {"CPU": 4.0, "node:__internal_head__": 1}}
    monkeypatch.setattr(ray, "nodes", lambda: [head])
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")


def test_a_joined_cluster_is_never_handed_this_machines_kept_salt_secret(home, fake_ray, monkeypatch, tmp_path):
    """With --address and a tenants file only the cluster's nodes have, the start handed every replica this
    machine's kept secret path, which outranks the `secret_file:` of the nodes' tenants file: a path the other
    nodes cannot read, or each node's own kept file (a salt per node for one tenant)."""
    from kvmesh.deployments.app import runtime_env_vars, stop_local
    from kvmesh.deployments.tenants import TenantRegistry, derive_salt

    _join(fake_ray, monkeypatch)
    on_the_nodes = tmp_path / "nodes" / "t.yaml"  # not on this machine yet
    _start({"tenants_file": str(on_the_nodes), "address": "10.0.0.5:6379"})
    try:
        assert "KVMESH_SALT_SECRET_FILE" not in runtime_env_vars()
        assert not (home / "salt-secret").exists()
        # a node's ingress, in the environment the run hands its replicas, salts from its own tenants file's secret
        _tenants_file(on_the_nodes.parent, EXPLICIT + "\n")
        assert TenantRegistry.from_file(on_the_nodes).tenants["acme"].salt == derive_salt(EXPLICIT.encode(), "acme")
    finally:
        stop_local(drain=False)


def test_a_joined_cluster_gets_the_salt_secret_set_here_and_a_warning_without_one(
    home, fake_ray, monkeypatch, tmp_path, caplog
):
    """A cluster with nodes elsewhere is handed the salt secret file the operator set or the `secret_file:` of
    a tenants file this machine has (paths the nodes are to have too); with neither, nothing is, and a warning
    says that each replica then salts from its node's secret or its own. KVMESH_SALT_SECRET alone is refused
    before anything is written: it reaches the replicas as a file written here, which those nodes lack."""
    from kvmesh.deployments.app import runtime_env_vars, stop_local

    _join(fake_ray, monkeypatch)
    joined = {"address": "10.0.0.5:6379"}
    with caplog.at_level("WARNING", logger="kvmesh.deployments.app"):
        _start(joined)
    stop_local(drain=False)
    assert [r.getMessage() for r in caplog.records if "no salt secret set here" in r.getMessage()]
    assert not (home / "salt-secret").exists()

    monkeypatch.setenv("KVMESH_SALT_SECRET", EXPLICIT)
    with pytest.raises(ConfigError, match="has nodes elsewhere") as refused:
        _start(joined)
    assert EXPLICIT not in str(refused.value) and "KVMESH_SALT_SECRET_FILE" in str(refused.value)
    assert _secret_files(home) == [] and os.environ.get("KVMESH_SALT_SECRET") == EXPLICIT
    on_the_nodes = str(tmp_path / "mounted-secret")  # where the operator says the nodes have it
    monkeypatch.setenv("KVMESH_SALT_SECRET_FILE", on_the_nodes)
    _start(joined)
    try:
        assert runtime_env_vars()["KVMESH_SALT_SECRET_FILE"] == on_the_nodes
    finally:
        stop_local(drain=False)
    monkeypatch.delenv("KVMESH_SALT_SECRET")
    monkeypatch.delenv("KVMESH_SALT_SECRET_FILE")

    tenants = _tenants_file(tmp_path / "conf", EXPLICIT + "\n")
    _start({**joined, "tenants_file": tenants})
    try:
        assert runtime_env_vars()["KVMESH_SALT_SECRET_FILE"] == str(tmp_path / "conf" / "salt-secret")
    finally:
        stop_local(drain=False)


def test_a_cluster_with_nodes_elsewhere_is_not_handed_a_channel_secret_written_here(
    home, fake_ray, monkeypatch, caplog
):
    """The KV-event streams' channel secret: a run's own is written under KVMESH_HOME, on this machine only.
    Handed to a cluster with nodes elsewhere, its path outranked the one those nodes set (KubeRay mounts one),
    and their engines and routers failed reading it. Not written then: the nodes' own is used (a warning
    says so), or the one configured here, by its path; a cluster on this machine gets the run's own."""
    from kvmesh.deployments.app import runtime_env_vars, stop_local

    _join(fake_ray, monkeypatch)
    with caplog.at_level("WARNING", logger="kvmesh.deployments.app"):
        _start({"address": "10.0.0.5:6379"})
    try:
        assert "KVMESH_CHANNEL_SECRET_FILE" not in runtime_env_vars()
        assert _secret_files(home) == []
    finally:
        stop_local(drain=False)
    assert [r.getMessage() for r in caplog.records if "no channel secret set here" in r.getMessage()]

    monkeypatch.setenv("KVMESH_CHANNEL_SECRET_FILE", "/run/secrets/kvmesh-channel")
    _start({"address": "10.0.0.5:6379"})
    try:
        assert runtime_env_vars()["KVMESH_CHANNEL_SECRET_FILE"] == "/run/secrets/kvmesh-channel"
    finally:
        stop_local(drain=False)
    monkeypatch.delenv("KVMESH_CHANNEL_SECRET_FILE")

    _start({"address": "127.0.0.1:6379"})
    try:
        own = runtime_env_vars()["KVMESH_CHANNEL_SECRET_FILE"]
        assert own.startswith(str(home / "run")) and os.path.exists(own)
    finally:
        stop_local(drain=False)
    assert _secret_files(home) == []


@pytest.mark.parametrize(
    "refusal",
    [PermissionError(errno.EPERM, "Operation not permitted"), OSError(errno.ENOTSUP, "Operation not supported")],
    ids=["EPERM", "ENOTSUP"],
)
def test_the_kept_salt_secret_is_made_where_the_filesystem_has_no_hard_links(home, monkeypatch, refusal):
    """Some FUSE, SMB or vfat homes refuse hard links: linking the staged file in failed the first run there,
    where creating the file in place worked. It is made in place then, and the first one made still wins."""
    from kvmesh.deployments import salt_secret

    def no_links(src, dst):
        raise refusal

    monkeypatch.setattr(os, "link", no_links)
    kept = salt_secret.persistent_secret_file()
    made = kept.read_text()
    assert kept == home / "salt-secret" and len(made) == 64 and stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert _secret_files(home) == []  # the copy written aside is gone
    assert salt_secret.persistent_secret_file().read_text() == made  # later runs use it

    theirs = "another-runs-salt-secret-0123456789abcdef"

    def another_run_first(src, dst):
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, theirs.encode())
        os.close(fd)
        raise refusal

    kept.unlink()
    monkeypatch.setattr(os, "link", another_run_first)
    assert salt_secret.persistent_secret_file().read_text() == theirs


def test_a_cluster_joined_on_this_machine_gets_the_kept_salt_secret(home, fake_ray, monkeypatch):
    """`ray start --head` here, then `kvmesh serve --address 127.0.0.1:6379`: every node is this machine, so
    the kept secret is every node's; without it each ingress replica generated its own (a salt per replica)."""
    from kvmesh.deployments.app import _cluster_is_here, runtime_env_vars, stop_local

    _join(fake_ray, monkeypatch)
    _start({"address": "127.0.0.1:6379"})
    try:
        assert runtime_env_vars()["KVMESH_SALT_SECRET_FILE"] == str(home / "salt-secret")
    finally:
        stop_local(drain=False)
    assert _cluster_is_here("localhost:6379") and not _cluster_is_here("10.0.0.5:6379")

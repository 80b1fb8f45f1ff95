"""The deploy plan: deployment options, resources and files from the config alone, and the Serve config
text `kvmesh k8s render` writes into a manifest."""

from __future__ import annotations

import pytest
import yaml

from kvmesh.deployments.app import initial_engine_replicas
from kvmesh.deployments.config import ConfigError, app_config
from kvmesh.deployments.deploy_plan import (
    ENGINE,
    INGRESS,
    actor_resources,
    engine_options,
    files_read,
    ingress_options,
    max_engine_replicas,
    render_serve_config,
    replace_block,
)

GPU = {"engine": {"model": "/models/m", "num_gpus": 1, "num_cpus": 8, "block_size": 16}}


def test_autoscaling_replaces_the_fixed_replica_count_and_sizes_the_ingress():
    cfg = app_config({**GPU, "autoscaling": {"min_replicas": 2, "max_replicas": 16}, "max_ongoing_requests": 64})
    opts = engine_options(cfg, {"A": "1"})
    assert opts["num_replicas"] == "auto" and opts["autoscaling_config"]["max_replicas"] == 16
    assert opts["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 1, "runtime_env": {"env_vars": {"A": "1"}}}
    assert ingress_options(cfg, {})["max_ongoing_requests"] == 64 * 16
    assert engine_options(app_config({}), {})["num_replicas"] == 2


@pytest.mark.parametrize(
    "auto",
    [
        {"target_ongoing_requests": 3},
        {"min_replicas": 0},
        {"initial_replicas": 1, "upscale_delay_s": 1.0},
        {"min_replicas": 2, "max_replicas": 5},
        {"max_replicas": 7},
        {"min_replicas": 2},  # accepted as Serve accepts it (the model's plain default max is 1)
        {"initial_replicas": 4},
    ],
)
def test_the_engine_maximum_is_what_serve_resolves_from_the_autoscaling_mapping(auto):
    """Without max_replicas Serve's num_replicas="auto" defaults apply (max 100), not `replicas` (the default 2
    a filled-in config still carries beside autoscaling)."""
    from ray import serve

    cfg = app_config({"autoscaling": auto, "max_ongoing_requests": 8})
    engine = serve.deployment(name=ENGINE)(object).options(**engine_options(cfg, {}))
    most = engine._deployment_config.autoscaling_config.max_replicas
    assert max_engine_replicas(cfg) == most == auto.get("max_replicas", 100)
    assert ingress_options(cfg, {})["max_ongoing_requests"] == max(256, 8 * most)
    assert max_engine_replicas(app_config({"replicas": 3})) == 3
    resolved = engine._deployment_config.autoscaling_config
    start = resolved.initial_replicas if resolved.initial_replicas is not None else resolved.min_replicas
    assert initial_engine_replicas(cfg) == start == auto.get("initial_replicas", auto.get("min_replicas", 1))


def test_the_engine_health_check_period_reaches_serve_and_must_be_positive():
    assert engine_options(app_config({}), {})["health_check_period_s"] == 10
    assert engine_options(app_config({"engine": {"health_check_period_s": 2}}), {})["health_check_period_s"] == 2
    for bad in (0, -1, True, "10"):
        with pytest.raises(ConfigError, match="health_check_period_s"):
            app_config({"engine": {"health_check_period_s": bad}})


def test_an_autoscaling_typo_is_a_config_error():
    with pytest.raises(ConfigError, match="target_ongoing_request"):
        app_config({"autoscaling": {"target_ongoing_request": 2}})


def test_resources_and_files_follow_the_config():
    cfg = {**GPU, "tenants_file": "/etc/t/tenants.yaml"}
    assert actor_resources(cfg) == {ENGINE: {"CPU": 8.0, "GPU": 1.0}, INGRESS: {"CPU": 0.1}}
    files = files_read(cfg, {"KVMESH_SALT_SECRET_FILE": "/etc/s/secret", "KVMESH_CHANNEL_SECRET_FILE": "/etc/c/ch"})
    assert files[ENGINE] == {"channel secret": "/etc/c/ch", "model": "/models/m"}
    assert files[INGRESS] == {
        "salt secret": "/etc/s/secret",
        "channel secret": "/etc/c/ch",
        "tokenizer": "/models/m",
        "tenants file": "/etc/t/tenants.yaml",
    }
    unset = {ENGINE: {"channel secret": None}, INGRESS: {"salt secret": None, "channel secret": None}}
    assert files_read({}, {}) == unset  # tiny model: built, not mounted; secrets' paths unknown without the env


def test_the_rendered_serve_config_carries_the_config_as_args_and_no_overrides():
    text = render_serve_config({**GPU, "name": "x", "route_prefix": "/x"})
    config = yaml.safe_load(text)
    app = config["applications"][0]
    assert app == {
        "name": "x",
        "route_prefix": "/x",
        "import_path": "kvmesh.deployments.app:build_app",
        "args": {**GPU, "name": "x", "route_prefix": "/x"},
    }
    with pytest.raises(ConfigError):
        render_serve_config({"replicas": 0})


def test_replace_block_keeps_the_rest_of_the_manifest():
    manifest = "a: 1  # keep\nspec:\n  block: |\n    old: 1\n\n    older: 2\n  after: 3\n"
    out = replace_block(manifest, "block", "new: 1\nlist:\n  - x\n")
    assert out == "a: 1  # keep\nspec:\n  block: |\n    new: 1\n    list:\n      - x\n  after: 3\n"
    assert yaml.safe_load(out)["spec"] == {"block": "new: 1\nlist:\n  - x\n", "after": 3}
    with pytest.raises(ValueError, match="no literal block"):
        replace_block(manifest, "missing", "x")


def test_a_cpu_engine_runs_as_many_openmp_threads_as_its_cpu_share_and_a_gpu_engine_is_left_alone():
    def omp(engine):
        return engine_options(app_config({"engine": engine}), {"A": "1"})["ray_actor_options"]["runtime_env"][
            "env_vars"
        ].get("OMP_NUM_THREADS")

    assert omp({}) == "1"  # the default half CPU: one thread, not one per core of the node
    assert omp({"num_cpus": 4}) == "4" and omp({"num_cpus": 2.5}) == "2"
    assert omp({"cpu_threads": 3}) == "3"
    assert omp(GPU["engine"]) is None
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="cpu_threads"):
            app_config({"engine": {"cpu_threads": bad}})


def test_engine_replicas_get_the_configured_drain_time_before_serve_kills_them():
    """Serve kills a removed replica after graceful_shutdown_timeout_s; a fixed 5 s cut off every longer
    answer at each downscale. GPU engines default to 60 s, CPU engines (tests, local runs) keep 5 s."""
    assert engine_options(app_config(GPU), {})["graceful_shutdown_timeout_s"] == 60
    assert engine_options(app_config({}), {})["graceful_shutdown_timeout_s"] == 5
    given = app_config({"engine": {**GPU["engine"], "drain_timeout_s": 300}})
    assert engine_options(given, {})["graceful_shutdown_timeout_s"] == 300


def test_a_stopping_replica_looks_for_its_last_requests_more_often_than_serves_default():
    """Serve sleeps graceful_shutdown_wait_loop_s (2 s by default) before a stopping replica's first look at its
    requests in flight: every stop, scale-down and replacement of an idle replica waited that long."""
    from kvmesh.deployments.deploy_plan import ingress_options

    for cfg in (app_config(GPU), app_config({})):
        assert engine_options(cfg, {})["graceful_shutdown_wait_loop_s"] < 2
        assert ingress_options(cfg, {})["graceful_shutdown_wait_loop_s"] < 2


def test_credentials_are_found_in_the_lmcache_servers_arguments_and_nowhere_else():
    from kvmesh.deployments.deploy_plan import argv_credentials, embedded_credentials

    adapter = '{"type": "resp", "host": "h", "port": 6379, "auth": {"password": "pw"}}'
    assert argv_credentials(["--l2-adapter", adapter]) == ["key 'password' in an argument"]
    assert argv_credentials(["--l2-adapter=" + adapter]) == ["key 'password' in an argument"]
    assert argv_credentials(["--p2p-listen-url", "tcp://u:pw@0.0.0.0:1"]) == ["a URL's user info in an argument"]
    assert argv_credentials(["--secret-key", "pw", "--user=kv"]) == ["flag --secret-key", "flag --user"]
    # LMCache server flags and values that hold no secret
    plain = ["--eviction-ratio", "0.2", "--coordinator-url", "http://coord:9000", "--l2-adapter", '{"type": "fs"}']
    assert argv_credentials(plain) == [] and argv_credentials(None) == [] and argv_credentials("--password") == []
    assert embedded_credentials({"use_token_cache": True, "api_key": None, "token": ""}) == []
    assert embedded_credentials({"nested": [{"aws_secret_access_key": "x"}]}) == ["key 'aws_secret_access_key'"]
    assert embedded_credentials("not json {") == [] and embedded_credentials("user@example.com") == []


@pytest.mark.parametrize(
    ("l2", "refused"),
    [
        ("redis://kvmesh-valkey:6379", False),
        ({"type": "resp", "host": "kvmesh-valkey", "port": 6379}, False),
        ("fs", False),
        (None, False),
        ("valkey://kvmesh-valkey:6379", True),
        ({"type": "valkey", "startup_nodes": "kvmesh-valkey:6379"}, True),
    ],
)
def test_only_the_valkey_adapter_is_refused_without_credentials(l2, refused):
    from kvmesh.deployments.deploy_plan import l2_problems

    problems = l2_problems(l2)
    assert bool(problems) == refused
    assert all("valkey adapter" in p and "redis://HOST:PORT" in p for p in problems)

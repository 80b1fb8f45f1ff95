"""The serving config (deployments/config.py): defaults, strict keys, file round trip, engine arguments,
per-run HAProxy files and ports."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.deployments.config import ConfigError, app_config, engine_config


# ---------------------------------------------------------------------------- config
def test_config_defaults_and_strict_keys():
    cfg = app_config({"replicas": 3, "engine": {"block_size": 64}})
    assert cfg["replicas"] == 3 and cfg["engine"]["block_size"] == 64 and cfg["policy"] == "kvmesh"
    with pytest.raises(ConfigError, match="unknown key"):
        app_config({"replica": 2})
    with pytest.raises(ConfigError, match="unknown key"):
        engine_config({"blocksize": 32})
    with pytest.raises(ConfigError, match="multiple of 32"):
        engine_config({"block_size": 16})
    assert engine_config({"block_size": 16, "num_gpus": 1})["block_size"] == 16  # GPUs take any size
    with pytest.raises(ConfigError, match="whole number"):
        engine_config({"kv_cache_space_gb": 0.5})
    with pytest.raises(ConfigError, match="hash_algo"):
        engine_config({"hash_algo": "md5"})
    with pytest.raises(ConfigError):
        app_config({"api_keys": "k"})
    assert cfg["proxy"] == "haproxy" and app_config({"proxy": "serve"})["proxy"] == "serve"
    with pytest.raises(ConfigError, match="proxy"):
        app_config({"proxy": "nginx"})
    # the prefix cache reset empties every tenant's cache: off unless the operator turns it on
    assert cfg["allow_cache_reset"] is False and app_config({"allow_cache_reset": True})["allow_cache_reset"]
    with pytest.raises(ConfigError, match="allow_cache_reset must be true or false"):
        app_config({"allow_cache_reset": "yes"})


@pytest.mark.parametrize("bad", [0, -1, "60", True, float("inf")])
def test_the_engines_drain_time_is_a_positive_number(bad):
    with pytest.raises(ConfigError, match="engine.drain_timeout_s"):
        engine_config({"drain_timeout_s": bad})
    assert engine_config({"drain_timeout_s": 0.5})["drain_timeout_s"] == 0.5
    assert engine_config({})["drain_timeout_s"] == 5 and engine_config({"num_gpus": 1})["drain_timeout_s"] == 60


def test_policy_names_and_parameters_are_checked_by_building_the_policy():
    cfg = app_config({"policy_params": {"guard_weight": 45, "cost": {"attention_s_per_token_pair": 1e-9}}})
    assert cfg["policy_params"]["guard_weight"] == 45
    with pytest.raises(ConfigError, match="config.policy 'kvmsh': unknown"):
        app_config({"policy": "kvmsh"})
    with pytest.raises(ConfigError, match="unknown parameter.*guard_wieght"):
        app_config({"policy_params": {"guard_wieght": 45}})
    with pytest.raises(ConfigError, match="cost model: unknown keys"):
        app_config({"policy_params": {"cost": {"prefil_s_per_token": 1e-4}}})
    with pytest.raises(ConfigError, match="balance_slack"):
        app_config({"policy_params": {"balance_slack": -1}})
    with pytest.raises(ConfigError, match="policy_params must map"):
        app_config({"policy_params": [1]})
    # round robin takes no parameters: kvmesh's are refused for it rather than ignored
    with pytest.raises(ConfigError, match="round_robin: unknown parameter"):
        app_config({"policy": "round_robin", "policy_params": {"guard_weight": 45}})
    with pytest.raises(ConfigError, match="tenant_policies: unknown policy 'nope'"):
        app_config({"tenant_policies": {"acme": "nope"}})
    assert app_config({"tenant_policies": {"acme": "round_robin"}})["tenant_policies"] == {"acme": "round_robin"}


def test_each_local_haproxy_run_gets_its_own_files_and_ports():
    """Serve's HAProxy defaults are per machine (/tmp/haproxy-serve, stats 8404, metrics 9101): two
    local clusters (the test app and a `kvmesh serve` subprocess) failed to start side by side."""
    import shutil

    from kvmesh.deployments.app import _proxy_env
    from kvmesh.deployments.config import SERVE_PATH_ENV

    a, b = _proxy_env("haproxy"), _proxy_env("haproxy")
    assert a["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for k in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_STATS_PORT"):
        assert a[k] != b[k]
    assert Path(a["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent.is_dir()
    # Serve's own proxy: no HAProxy files or ports, only the HA-proxy switch, the proxy readiness bound
    # and the request-path settings every local run gets
    serve = _proxy_env("serve")
    fallback = {k: serve.pop(k) for k in ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")}
    assert all(port.isdigit() for port in fallback.values())  # per run: the test below
    assert serve == {
        **SERVE_PATH_ENV,
        "RAY_SERVE_ENABLE_HA_PROXY": "0",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
        "SERVE_SOCKET_REUSE_PORT_ENABLED": "0",
    }
    assert SERVE_PATH_ENV.items() <= a.items()
    # every file Serve's HAProxy manager would put under the machine-wide /tmp/haproxy-serve goes to the
    # run's own folder (one left out leaves a folder per node behind there)
    import ray.serve._private.constants as serve_constants

    run = a["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    machine_wide = [
        name
        for name, value in vars(serve_constants).items()
        if name.startswith("RAY_SERVE_HAPROXY_") and isinstance(value, str) and value.startswith("/tmp/haproxy-serve")
    ]
    assert "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH" in machine_wide
    assert {name: a.get(name, "").startswith(run) for name in machine_wide} == dict.fromkeys(machine_wide, True)
    for env in (a, b):
        shutil.rmtree(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])


def test_a_local_haproxy_gets_threads_by_the_machines_cpus_unless_the_operator_chose(monkeypatch):
    import shutil

    from kvmesh.deployments import app

    assert [app.haproxy_threads(n) for n in (1, 2, 4, 7, 8, 15, 16, 64)] == [1, 1, 1, 1, 2, 3, 4, 4]
    monkeypatch.delenv(app.NBTHREAD_ENV, raising=False)
    monkeypatch.setattr(app.os, "cpu_count", lambda: 2)
    env = app._proxy_env("haproxy")
    assert env[app.NBTHREAD_ENV] == "1"
    shutil.rmtree(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
    monkeypatch.setenv(app.NBTHREAD_ENV, "3")
    env = app._proxy_env("haproxy")
    assert app.NBTHREAD_ENV not in env  # os.environ.update(env) keeps the operator's 3
    shutil.rmtree(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
    assert app.NBTHREAD_ENV not in app._proxy_env("serve")


@pytest.mark.parametrize("proxy", ["haproxy", "serve"])
def test_each_local_run_gets_its_own_fallback_proxy_ports(proxy):
    """Serve's fallback proxy (HAProxy's backup server while no ingress replica runs) listened on the fixed
    127.0.0.1:8500 with SO_REUSEPORT: two local runs shared it, and one run's prompts reached the other's app."""
    import shutil

    import ray.serve._private.constants as serve_constants

    from kvmesh.deployments.app import _proxy_env

    names = ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
    assert all(hasattr(serve_constants, name) for name in names), "Serve renamed its fallback proxy's settings"
    a, b = _proxy_env(proxy), _proxy_env(proxy)
    try:
        ports = [int(env[name]) for env in (a, b) for name in names]
        assert len(set(ports)) == 4, f"two runs (or HTTP and gRPC) share a fallback port: {ports}"
        assert {serve_constants.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT, 8500, 9500}.isdisjoint(ports)
    finally:
        for env in (a, b):
            if "RAY_SERVE_HAPROXY_SERVER_STATE_BASE" in env:
                shutil.rmtree(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])


@pytest.mark.parametrize("proxy", ["haproxy", "serve"])
def test_serves_python_proxies_of_a_local_run_bind_without_so_reuseport(proxy):
    """With SO_REUSEPORT (Serve's Python proxy's default) a second run on a port already bound listened beside
    the first and took half its clients; the name is the one Ray 2.60's proxy reads."""
    import inspect
    import shutil

    import ray.serve._private.proxy as serve_proxy

    from kvmesh.deployments.app import _proxy_env

    assert 'os.environ.get("SERVE_SOCKET_REUSE_PORT_ENABLED"' in inspect.getsource(serve_proxy)
    env = _proxy_env(proxy)
    if "RAY_SERVE_HAPROXY_SERVER_STATE_BASE" in env:
        shutil.rmtree(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
    assert env["SERVE_SOCKET_REUSE_PORT_ENABLED"] == "0"


def test_serve_config_file_round_trip(tmp_path):
    from kvmesh.deployments.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text("replicas: 4\npolicy: round_robin\nengine: {block_size: 64, max_model_len: 1024}\n")
    cfg = load_config(p)
    assert (cfg["replicas"], cfg["policy"], cfg["engine"]["max_model_len"]) == (4, "round_robin", 1024)
    p.write_text("- 1\n")
    with pytest.raises(ConfigError):
        load_config(p)


# ---------------------------------------------------------------------------- router with fake replicas


def test_engine_args_carry_the_config(tiny_model_dir):
    from kvmesh.deployments.engine_driver import build_engine_args

    cfg = engine_config(
        {"block_size": 64, "stream_interval": 4, "hash_algo": "sha256_cbor", "num_gpu_blocks_override": 100}
    )
    args = build_engine_args(
        cfg,
        str(tiny_model_dir),
        {"endpoint": "tcp://*:5999", "topic": "kvmesh"},
        {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"},
    )
    assert (args.block_size, args.stream_interval, args.prefix_caching_hash_algo) == (64, 4, "sha256_cbor")
    assert args.enable_prefix_caching and args.num_gpu_blocks_override == 100
    assert args.kv_events_config.enable_kv_cache_events and args.kv_events_config.endpoint == "tcp://*:5999"
    assert args.kv_transfer_config.kv_connector == "LMCacheMPConnector"
    assert args.scheduling_policy == "fcfs"  # vLLM's default: arrival order, a request's priority unread
    args = build_engine_args(engine_config({"scheduling_policy": "priority"}), str(tiny_model_dir), None, None)
    assert args.scheduling_policy == "priority"
    with pytest.raises(ConfigError):
        engine_config({"stream_interval": 0})
    with pytest.raises(ConfigError, match="engine.scheduling_policy must be 'fcfs' or 'priority'"):
        engine_config({"scheduling_policy": "lifo"})


def test_embedded_tiny_model_runs_in_float32_unless_a_dtype_is_given(tiny_model_dir):
    """vLLM's CPU "auto" would cast the float32 tiny model to bfloat16, whose AMX attention kernel dies
    with SIGILL where the process is not granted AMX state; a dtype the operator sets is kept."""
    from kvmesh.deployments.config import engine_dtype
    from kvmesh.deployments.engine_driver import build_engine_args

    args = build_engine_args(engine_config({}), str(tiny_model_dir), None, None)
    assert args.dtype == "float32"
    assert build_engine_args(engine_config({"dtype": "bfloat16"}), str(tiny_model_dir), None, None).dtype == "bfloat16"
    assert engine_dtype("tiny", "auto") == "float32"
    assert engine_dtype("/models/llama-8b", "auto") == "auto"


def test_cpu_only_defaults_stay_off_gpu_engines(tiny_model_dir):
    """Eager mode and 32 sequences suit a CPU engine; a GPU engine keeps vLLM's own defaults (CUDA
    graphs, vLLM's batch size) unless the config sets them."""
    from kvmesh.deployments.engine_driver import build_engine_args

    cpu, gpu = engine_config({}), engine_config({"num_gpus": 1, "block_size": 16})
    assert (cpu["enforce_eager"], cpu["max_num_seqs"]) == (True, 32)
    assert (gpu["enforce_eager"], gpu["max_num_seqs"]) == (False, None)
    args = build_engine_args(gpu, str(tiny_model_dir), None, None)
    assert args.enforce_eager is False and args.max_num_seqs is None
    set_by_hand = engine_config({"num_gpus": 1, "enforce_eager": True, "max_num_seqs": 8})
    assert (set_by_hand["enforce_eager"], set_by_hand["max_num_seqs"]) == (True, 8)
    assert engine_config(gpu) == gpu  # filling twice changes nothing (the app config is validated again)


def test_a_gpu_engine_without_engine_mode_gets_the_async_driver(monkeypatch):
    """Every replica's runtime env sets VLLM_ENABLE_V1_MULTIPROCESSING=0 (the in-process CPU default), so the
    env cannot choose a GPU engine's driver: one without engine_mode gets AsyncLLM, the GPU path; a CPU engine
    the env's in-process driver, and an explicit engine_mode is kept."""
    from kvmesh.deployments import engine_driver
    from kvmesh.deployments.app import runtime_env_vars

    for key, value in runtime_env_vars().items():  # what an engine replica's process runs with
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(engine_driver, "InprocDriver", lambda *a, **k: "inproc")
    monkeypatch.setattr(engine_driver, "AsyncDriver", lambda *a, **k: "async")

    def driver(raw: dict) -> str:
        return engine_driver.make_driver(engine_config(raw)["engine_mode"], None)

    assert driver({"num_gpus": 1, "model": "/models/llama"}) == "async"
    assert driver({"num_gpus": 0.5, "block_size": 16}) == "async"
    assert driver({}) == "inproc"
    assert driver({"num_gpus": 1, "engine_mode": "inproc"}) == "inproc"
    assert driver({"engine_mode": "async"}) == "async"


def test_the_step_fault_gets_the_in_process_driver_and_an_async_engine_refuses_it(monkeypatch):
    """engine.fail_step_after is a fault of the in-process driver only (make_driver hands it to no other): a
    GPU engine without engine_mode got the async driver and ran without the fault, the config accepted."""
    from kvmesh.deployments import engine_driver
    from kvmesh.deployments.config import ConfigError

    monkeypatch.setattr(engine_driver, "InprocDriver", lambda args, fail_step_after: ("inproc", fail_step_after))
    monkeypatch.setattr(engine_driver, "AsyncDriver", lambda *a, **k: ("async", None))
    for raw in ({"num_gpus": 1, "fail_step_after": 5}, {"fail_step_after": 5}):
        cfg = engine_config(raw)
        assert engine_driver.make_driver(cfg["engine_mode"], None, cfg["fail_step_after"]) == ("inproc", 5)
    with pytest.raises(ConfigError, match=r"^engine.fail_step_after \(test-only\) is a fault of the in-process"):
        engine_config({"num_gpus": 1, "engine_mode": "async", "fail_step_after": 5})
    assert engine_config({"num_gpus": 1})["engine_mode"] == "async"  # without the fault, as before


def test_xxhash_with_several_tenants_needs_the_operators_explicit_acceptance():
    from kvmesh.deployments.config import ConfigError, app_config

    for tenants in ({"tenants_file": "tenants.yaml"}, {"api_keys": ["kvm-a" * 8, "kvm-b" * 8]}):
        with pytest.raises(ConfigError, match="xxhash with several tenants .* accept_hash_collision_risk: true"):
            app_config({"engine": {"hash_algo": "xxhash"}, **tenants})
        accepted = app_config({"engine": {"hash_algo": "xxhash"}, "accept_hash_collision_risk": True, **tenants})
        assert accepted["engine"]["hash_algo"] == "xxhash"
    assert app_config({"engine": {"hash_algo": "xxhash"}, "api_keys": ["kvm-a" * 8]})["engine"]["hash_algo"] == "xxhash"
    assert app_config({"tenants_file": "tenants.yaml"})["engine"]["hash_algo"] == "sha256"


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("engine", "block_size", True),  # YAML `yes`: a bool is not a size
        ("engine", "max_model_len", True),
        ("engine", "kv_cache_space_gb", True),
        ("engine", "stream_interval", True),
        ("engine", "cpu_threads", True),
        ("engine", "health_check_period_s", float("nan")),
        ("engine", "health_check_period_s", float("inf")),
        ("engine", "fail_step_after", False),
        ("config", "max_migrations", True),
    ],
)
def test_a_bool_or_non_finite_value_is_not_a_number_setting(section, key, value):
    raw = {"engine": {"num_gpus": 1, key: value}} if section == "engine" else {key: value}
    with pytest.raises(ConfigError, match=key):
        app_config(raw)


def test_a_tiny_model_built_anywhere_runs_in_float32(tiny_model_dir, tmp_path, monkeypatch):
    """`kvmesh model build-tiny DIR` served as `--model DIR`, or kvmesh's own folder named by a symlink or a
    relative path, is the float32 tiny model too: "auto" there was vLLM's bfloat16 on CPU (the AMX kernel that
    dies with SIGILL). The build's stamp marks it; a folder without one keeps "auto"."""
    import shutil

    from kvmesh.deployments.config import engine_dtype
    from kvmesh.deployments.engine_driver import build_engine_args

    built = tmp_path / "built"
    shutil.copytree(tiny_model_dir, built)  # a build elsewhere: its files and stamp
    link = tmp_path / "link"
    link.symlink_to(tiny_model_dir)
    monkeypatch.chdir(tiny_model_dir.parent)
    for model in (str(built), str(link), f"./{tiny_model_dir.name}", str(tiny_model_dir)):
        assert engine_dtype(model, "auto") == "float32", model
        assert engine_dtype(model, "bfloat16") == "bfloat16", model  # a dtype the operator sets is kept
    args = build_engine_args(engine_config({"model": str(built)}), str(built), None, None)
    assert args.dtype == "float32"
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    not_a_stamp = tmp_path / "not_a_stamp"
    not_a_stamp.mkdir()
    (not_a_stamp / "kvmesh_tiny.json").write_text('["version", 2]')
    for model in (str(other), str(not_a_stamp), str(tmp_path / "missing"), "/models/llama-8b"):
        assert engine_dtype(model, "auto") == "auto", model


@pytest.mark.parametrize(
    ("engine", "needle"),
    [
        ({"enforce_eager": "maybe"}, "engine.enforce_eager must be true, false or null, got 'maybe'"),
        ({"enforce_eager": 1}, "engine.enforce_eager must be true, false or null, got 1"),
        (
            {"dtype": "float33"},
            "engine.dtype must be one of auto, half, float16, bfloat16, float, float32, got 'float33'",
        ),
        ({"dtype": None}, "engine.dtype must be one of"),
        (
            {"kv_transfer_config": "LMCacheConnectorV1"},
            "engine.kv_transfer_config must be a mapping of vLLM KVTransferConfig keys, got 'LMCacheConnectorV1'",
        ),
        ({"kv_transfer_config": {1: 2}}, "engine.kv_transfer_config must be a mapping of vLLM KVTransferConfig keys"),
        (
            {"kv_transfer_config": {"kv_conector": "LMCacheConnectorV1", "kv_role": "kv_both"}},
            "engine.kv_transfer_config.kv_conector: Unexpected keyword argument",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "both"}},
            "engine.kv_transfer_config.kv_role: Input should be 'kv_producer', 'kv_both' or 'kv_consumer'",
        ),
    ],
)
def test_engine_keys_vllm_would_refuse_in_every_replica_stop_the_config(engine, needle):
    """Each was accepted and failed only inside every engine replica, after Ray and vLLM started (Serve retried
    the replica, then DEPLOY_FAILED): now one line naming the key."""
    if "kv_conector" in str(engine) or "kv_role" in str(engine):
        pytest.importorskip("vllm.config")  # vLLM's own checks: without vLLM only the mapping's shape is checked
    with pytest.raises(ConfigError) as err:
        app_config({"engine": engine})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_engine_keys_vllm_takes_still_load():
    pytest.importorskip("vllm.config")
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    takes = ({"dtype": "half"}, {"enforce_eager": True}, {"enforce_eager": None}, {"kv_transfer_config": lmcache})
    for engine in takes:
        cfg = app_config({"engine": engine})["engine"]
        assert all(cfg[key] == value for key, value in engine.items() if value is not None)
    assert app_config({"engine": {"enforce_eager": False, "num_gpus": 1}})["engine"]["enforce_eager"] is False


def test_the_dtype_names_are_vllms():
    """config.py restates vLLM's dtype names (checked without importing vLLM): the two agree."""
    import typing

    from kvmesh.deployments.config import VLLM_DTYPES

    model = pytest.importorskip("vllm.config.model")
    assert set(VLLM_DTYPES) == set(typing.get_args(model.ModelDType))


def test_replicas_beside_autoscaling_is_refused_not_dropped():
    """Serve deploys an autoscaled engine deployment with num_replicas "auto": `replicas: 4` beside it was
    dropped unsaid (the CLI refuses --replicas there already). The default count a filled config carries passes."""
    auto = {"min_replicas": 1, "max_replicas": 2}
    with pytest.raises(ConfigError, match=r"^config\.replicas \(4\) and config\.autoscaling exclude each other"):
        app_config({"replicas": 4, "autoscaling": auto})
    cfg = app_config({"autoscaling": auto})
    assert app_config(cfg)["autoscaling"] == auto  # checked again, as `kvmesh serve` and build_app do
    assert app_config({"replicas": 4})["replicas"] == 4


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        ({1: 2}, "config.autoscaling.policy: keys must be names (strings), got 1"),
        ({"policy_fuction": "m:f"}, "config.autoscaling.policy: unknown key(s) policy_fuction"),
    ],
)
def test_an_autoscaling_policy_mapping_names_its_key(policy, needle):
    """`policy: {1: 2}` printed "error: keywords must be strings" (Pydantic's TypeError, naming no key); a misspelt
    policy key was dropped by Serve's model and the default policy ran."""
    pytest.importorskip("ray.serve.config")
    with pytest.raises(ConfigError) as err:
        app_config({"autoscaling": {"policy": policy}})
    assert str(err.value).startswith(needle)


@pytest.mark.parametrize(
    "address",
    ["head:6379", "10.0.0.1:6379", "127.0.0.1:6379", "[::1]:6379", "ray-head.ns.svc.cluster.local:6379", None],
)
def test_a_gcs_address_loads(address):
    assert app_config({"address": address})["address"] == address


@pytest.mark.parametrize(
    "address",
    ["head:99999", "head:0", "http://head:6379", "a b:6379", "head:", ":6379", "::1:6379", "[zz]:6379", "head", 6379],
)
def test_a_cluster_address_that_is_not_host_and_port_is_refused(address):
    """Only "something:digits" was asked: head:99999, http://head:6379 and "a b:6379" passed to Ray's retries."""
    with pytest.raises(ConfigError, match=r"^config\.address must be a Ray cluster's GCS address host:port"):
        app_config({"address": address})


def test_a_ray_client_address_is_refused_with_what_to_give_instead():
    with pytest.raises(ConfigError) as err:
        app_config({"address": "ray://head:10001"})
    assert str(err.value) == (
        "config.address: 'ray://head:10001' is a Ray Client address; give the cluster's GCS address host:port "
        "(default port 6379)"
    )

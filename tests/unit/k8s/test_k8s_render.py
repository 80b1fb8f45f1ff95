"""`kvmesh k8s render` on copies of k8s/config/kvmesh.yaml and k8s/rayservice.yaml: it writes only a config
the manifest can run, and refuses the rest with one line and exit status 2, leaving the manifest as it was."""

from __future__ import annotations

import re

import pytest
import yaml
from paths import REPO_ROOT

from kvmesh.deployments.cli import main

K8S = REPO_ROOT / "k8s"


@pytest.fixture
def files(tmp_path):
    """(config path, manifest path): the repository's own pair, in a scratch folder."""
    config = tmp_path / "kvmesh.yaml"
    manifest = tmp_path / "rayservice.yaml"
    config.write_text((K8S / "config" / "kvmesh.yaml").read_text())
    manifest.write_text((K8S / "rayservice.yaml").read_text())
    return config, manifest


def _with(config_path, **changes) -> None:
    """Rewrite the config with top-level keys changed (engine given whole)."""
    raw = yaml.safe_load(config_path.read_text())
    raw.update(changes)
    config_path.write_text(yaml.safe_dump(raw))


def _lmcache_l2(config_path, l2) -> None:
    raw = yaml.safe_load(config_path.read_text())
    raw["engine"]["lmcache"]["l2"] = l2
    config_path.write_text(yaml.safe_dump(raw))


def render(files, capsys, *extra: str) -> tuple[int, str]:
    config, manifest = files
    rc = main(["k8s", "render", "--config", str(config), "--manifest", str(manifest), *extra])
    return rc, capsys.readouterr().err


def refused(files, capsys) -> str:
    """Render must refuse: exit 2, one line on stderr, the manifest untouched. Returns that line."""
    before = files[1].read_text()
    rc, err = render(files, capsys)
    assert rc == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert files[1].read_text() == before
    return err


def test_the_repositorys_config_renders_and_checks_up_to_date(files, capsys):
    assert render(files, capsys) == (0, "")
    assert render(files, capsys, "--check") == (0, "")


@pytest.mark.parametrize(
    "l2",
    [
        "redis://:s3cret-pw@kvmesh-valkey:6379",
        "redis://kvmesh:s3cret-pw@kvmesh-valkey:6379",
    ],
    ids=["password", "user-and-password"],
)
def test_render_refuses_a_password_in_the_l2_url(files, capsys, l2):
    """serveConfigV2 holds the config verbatim and Serve logs the app's args: a password there is published."""
    _lmcache_l2(files[0], l2)
    err = refused(files, capsys)
    assert "engine.lmcache.l2" in err and "LMCACHE_RESP_PASSWORD" in err and "Secret" in err
    assert "s3cret-pw" not in err


def test_render_refuses_credentials_in_an_l2_adapter_dict(files, capsys):
    _lmcache_l2(files[0], {"type": "resp", "host": "kvmesh-valkey", "port": 6379, "password": "s3cret-pw"})
    err = refused(files, capsys)
    assert "key 'password'" in err and "LMCACHE_RESP_PASSWORD" in err and "s3cret-pw" not in err


def test_render_refuses_another_adapters_credentials_whatever_their_names(files, capsys):
    _lmcache_l2(files[0], {"type": "s3", "bucket": "kv", "aws_secret_access_key": "s3cret-pw"})
    err = refused(files, capsys)
    assert "aws_secret_access_key" in err and "s3cret-pw" not in err


def test_render_takes_an_l2_url_without_credentials(files, capsys):
    _lmcache_l2(files[0], "redis://kvmesh-valkey:6379")
    assert render(files, capsys) == (0, "")


@pytest.mark.parametrize(
    "l2",
    [
        "valkey://kvmesh-valkey:6379",
        {"type": "valkey", "startup_nodes": "kvmesh-valkey:6379"},
        "valkey://:s3cret-pw@kvmesh-valkey:6379",
    ],
    ids=["url", "dict", "url-with-password"],
)
def test_render_refuses_the_valkey_adapter_which_reads_no_password_from_the_pods_environment(files, capsys, l2):
    """LMCache's valkey adapter reads its password only from its own settings (never LMCACHE_RESP_PASSWORD): without
    it there, it cannot authenticate to the manifest's Valkey (--requirepass); with it, serveConfigV2 publishes
    it. The advice is the resp adapter (redis://), whose password comes from the pod's environment."""
    _lmcache_l2(files[0], l2)
    err = refused(files, capsys)
    assert "valkey adapter" in err and "use redis://HOST:PORT" in err and "LMCACHE_RESP_PASSWORD" in err, err
    assert "s3cret-pw" not in err
    assert ("the URL's user info" in err) == (isinstance(l2, str) and "s3cret" in l2)


def test_the_advice_for_an_l2_password_follows_its_adapter(files, capsys):
    """redis://: the workers' LMCACHE_RESP_PASSWORD replaces it; another adapter does not read that variable."""
    _lmcache_l2(files[0], {"type": "s3", "bucket": "kv", "aws_secret_access_key": "s3cret-pw"})
    err = refused(files, capsys)
    assert "LMCache's s3 adapter must find its credentials in the engine pods' environment" in err, err
    _lmcache_l2(files[0], "redis://:s3cret-pw@kvmesh-valkey:6379")
    err = refused(files, capsys)
    assert "remove them and give the GPU workers LMCACHE_RESP_PASSWORD" in err and "s3 adapter" not in err, err


ADAPTER_WITH_PASSWORD = '{"type": "resp", "host": "kvmesh-valkey", "port": 6379, "password": "s3cret-pw"}'


@pytest.mark.parametrize(
    ("extra_args", "where"),
    [
        (["--l2-adapter", ADAPTER_WITH_PASSWORD], "key 'password' in an argument"),
        ([f"--l2-adapter={ADAPTER_WITH_PASSWORD}"], "key 'password' in an argument"),
        (["--coordinator-url", "http://kv:s3cret-pw@coordinator:9000"], "a URL's user info in an argument"),
        (["--password", "s3cret-pw"], "flag --password"),
        (["--auth-token=s3cret-pw"], "flag --auth-token"),
    ],
    ids=["adapter-json", "adapter-json-joined", "url", "flag", "flag-joined"],
)
def test_render_refuses_credentials_in_the_lmcache_servers_extra_args(files, capsys, extra_args, where):
    """serveConfigV2 holds the config verbatim: a password among the server's arguments was published there (and
    on the server's command line) while the same password as an l2 key was refused."""
    raw = yaml.safe_load(files[0].read_text())
    raw["engine"]["lmcache"]["extra_args"] = extra_args
    files[0].write_text(yaml.safe_dump(raw))
    err = refused(files, capsys)
    assert f"engine.lmcache.extra_args carries credentials ({where})" in err, err
    assert "s3cret-pw" not in err and "LMCACHE_RESP_PASSWORD" in err


def test_render_refuses_credentials_in_the_kv_connector_settings(files, capsys):
    raw = yaml.safe_load(files[0].read_text())
    raw["engine"]["kv_transfer_config"] = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"remote_url": "redis://:s3cret-pw@kvmesh-valkey:6379", "api_token": "s3cret"},
    }
    files[0].write_text(yaml.safe_dump(raw))
    err = refused(files, capsys)
    assert "engine.kv_transfer_config carries credentials (" in err and "key 'api_token'" in err, err
    assert "a URL's user info" in err and "LMCACHE_RESP_PASSWORD" in err
    assert "s3cret" not in err


def test_render_takes_extra_args_and_kv_connector_settings_without_credentials(files, capsys):
    raw = yaml.safe_load(files[0].read_text())
    raw["engine"]["lmcache"]["extra_args"] = ["--eviction-ratio", "0.2", "--coordinator-url", "http://coord:9000"]
    raw["engine"]["kv_transfer_config"] = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"use_token_ids": True, "lmcache.mp.port": 1},
    }
    files[0].write_text(yaml.safe_dump(raw))
    assert render(files, capsys) == (0, "")


def test_render_refuses_a_route_prefix_the_pod_monitor_does_not_scrape(files, capsys):
    """The ingress serves /metrics under the app's route prefix (/llm/metrics), and
    k8s/monitoring/podmonitor.yaml scrapes /metrics: every kvmesh_* series would go empty."""
    _with(files[0], route_prefix="/llm")
    err = refused(files, capsys)
    assert "config.route_prefix '/llm' moves the ingress's /metrics to /llm/metrics" in err
    assert "k8s/monitoring/podmonitor.yaml" in err
    monitor = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    assert {"port": "serve", "path": "/metrics"}.items() <= monitor["spec"]["podMetricsEndpoints"][0].items()


def _cpu_engines(config_path) -> None:
    """CPU engines small enough for the head pod (2 CPUs) as well as the GPU workers."""
    raw = yaml.safe_load(config_path.read_text())
    raw["engine"].update(num_gpus=0, num_cpus=1, kv_cache_space_gb=4, block_size=32, drain_timeout_s=20)
    raw["engine"]["lmcache"]["l1_size_gb"] = 8
    config_path.write_text(yaml.safe_dump(raw))


def test_render_refuses_engines_that_may_land_where_the_shared_tiers_password_is_not(files, capsys):
    """The head has no LMCACHE_RESP_PASSWORD (and Valkey's network policy admits only the GPU workers): a CPU engine
    that fits on the head would start a node LMCache server there that cannot authenticate to the shared tier."""
    _cpu_engines(files[0])
    err = refused(files, capsys)
    assert "engine replicas fit on pod group(s) head, which lack the LMCACHE_RESP_PASSWORD that gpu-engines" in err
    assert "engine.resources" in err
    # pinned to the GPU workers by a custom resource only they have, the engines render
    manifest = files[1].read_text()
    group = "      - groupName: gpu-engines\n"
    params = "        rayStartParams:\n"
    at = manifest.index(params, manifest.index(group)) + len(params)
    files[1].write_text(manifest[:at] + '          resources: \'"{\\"kvmesh_engine\\": 1}"\'\n' + manifest[at:])
    raw = yaml.safe_load(files[0].read_text())
    raw["engine"]["resources"] = {"kvmesh_engine": 1}
    files[0].write_text(yaml.safe_dump(raw))
    assert render(files, capsys) == (0, "")


def _head_container_edit(manifest_path, drop_salt_file: bool = False, env_from: bool = False) -> None:
    """Edit the head's Ray container as text (render keeps the manifest's own layout): drop its salt secret
    file variable, and/or have it take a Secret whole (`envFrom`)."""
    text = manifest_path.read_text()
    salt = "                - name: KVMESH_SALT_SECRET_FILE\n                  value: /etc/kvmesh/salt/secret\n"
    head = "            - name: ray-head\n"
    assert text.count(head) == 1
    at = text.index(head)
    if drop_salt_file:
        at_salt = text.index(salt, at)  # the head's own entry (the workers' are indented deeper)
        text = text[:at_salt] + text[at_salt + len(salt) :]
    if env_from:
        env = text.index("              env:\n", at)
        env_from_lines = "              envFrom:\n                - secretRef:\n                    name: extra\n"
        text = text[:env] + env_from_lines + text[env:]
    manifest_path.write_text(text)


def test_a_variable_a_container_may_take_from_envfrom_is_not_reported_missing(files, capsys):
    """`envFrom` (a Secret or ConfigMap taken whole) sets variables the manifest does not name: the salt secret's
    path, the shared tier's password. Render cannot see them, so it does not refuse them as missing (it did, so a
    manifest keeping them in a Secret could not be rendered at all); without envFrom a missing one is refused."""
    _head_container_edit(files[1], drop_salt_file=True)
    assert "not mounted: Ingress on head: salt secret (None)" in refused(files, capsys)
    _head_container_edit(files[1], env_from=True)
    assert render(files, capsys) == (0, "")

    _cpu_engines(files[0])  # engines that may land on the head, which names no LMCACHE_RESP_PASSWORD
    assert render(files, capsys) == (0, ""), "the head's envFrom may hold it"


@pytest.mark.parametrize(
    ("key", "value", "set_by"),
    [
        ("host", "0.0.0.0", "http_options"),
        ("port", 8000, "http_options"),
        ("proxy", "serve", "RAY_SERVE_ENABLE_HA_PROXY"),
        ("address", "kvmesh-head-svc:6379", "KubeRay"),
    ],
)
def test_render_refuses_keys_that_kuberay_sets_elsewhere(files, capsys, key, value, set_by):
    _with(files[0], **{key: value})
    err = refused(files, capsys)
    assert f"config.{key} has no effect on KubeRay" in err and set_by in err


def test_render_refuses_an_engine_that_fits_no_pod(files, capsys):
    raw = yaml.safe_load(files[0].read_text())
    raw["engine"]["num_gpus"] = 2  # the GPU workers have one GPU each
    files[0].write_text(yaml.safe_dump(raw))
    assert "EngineReplica fits on no pod group" in refused(files, capsys)


def test_render_refuses_a_file_the_pods_do_not_mount(files, capsys):
    _with(files[0], tenants_file="/etc/elsewhere/tenants.yaml")
    err = refused(files, capsys)
    assert "not mounted: Ingress on head: tenants file (/etc/elsewhere/tenants.yaml)" in err


def test_render_refuses_more_engines_than_the_worker_groups_hold(files, capsys):
    raw = yaml.safe_load(files[0].read_text())
    raw["autoscaling"]["max_replicas"] = 17  # maxReplicas 16 GPU pods, one engine each
    files[0].write_text(yaml.safe_dump(raw))
    assert "up to 17 engine replicas, but the worker groups hold at most 16" in refused(files, capsys)


def test_render_refuses_an_engine_pod_grace_period_not_above_the_engines_drain_time(files, capsys):
    """Kubernetes kills a pod its grace period after stopping it: within the engines' drain time, a draining
    engine's requests would be cut off. A pod spec without one gets Kubernetes' 30 s."""
    raw = yaml.safe_load(files[0].read_text())
    raw["engine"]["drain_timeout_s"] = 120  # the GPU workers' grace period is 90 s
    files[0].write_text(yaml.safe_dump(raw))
    err = refused(files, capsys)
    assert "pod group gpu-engines: terminationGracePeriodSeconds 90 is not above engine.drain_timeout_s 120" in err
    raw["engine"]["drain_timeout_s"] = 60
    files[0].write_text(yaml.safe_dump(raw))
    manifest = files[1].read_text()
    files[1].write_text(re.sub(r"\n *terminationGracePeriodSeconds: 90\n", "\n", manifest))
    assert "terminationGracePeriodSeconds 30 is not above engine.drain_timeout_s 60" in refused(files, capsys)


@pytest.mark.parametrize("broken", ["config", "manifest"])
def test_a_file_that_is_not_utf8_is_named_as_itself(files, capsys, broken):
    config, manifest = files
    path = config if broken == "config" else manifest
    path.write_bytes(path.read_bytes() + b"# caf\xe9\n")  # Latin-1, not UTF-8
    other = manifest if broken == "config" else config
    rc, err = render(files, capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"{path} is not UTF-8 text" in err and str(other) not in err


ANNOTATION = "kvmesh.io/node-server-config"


def _templates(manifest_path) -> dict[str, dict]:
    """group name -> pod template of the RayService in the manifest."""
    cluster = yaml.safe_load(manifest_path.read_text())["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return out


def _digests(manifest_path) -> dict[str, str | None]:
    return {
        name: (t["metadata"].get("annotations") or {}).get(ANNOTATION) for name, t in _templates(manifest_path).items()
    }


def test_a_changed_lmcache_setting_changes_every_ray_pod_template(files, capsys):
    """Each node's LMCache server keeps the settings it started with, and KubeRay applies a change of
    serveConfigV2 alone to the running cluster in place: render stamps a digest of engine.lmcache on the head's
    and every worker group's pod template, inside rayClusterConfig (what KubeRay hashes to decide on a new
    RayCluster), so changing it changes the cluster spec."""
    config, manifest = files
    assert render(files, capsys) == (0, "")
    before = _digests(manifest)
    assert set(before) == {"head", "gpu-engines"} and len(set(before.values())) == 1 and None not in before.values()
    cluster_before = yaml.safe_load(manifest.read_text())["spec"]["rayClusterConfig"]
    for key, value in (("l1_size_gb", 64), ("chunk_size", 512), ("l2", "redis://kvmesh-valkey-2:6379")):
        raw = yaml.safe_load(config.read_text())
        original = raw["engine"]["lmcache"][key]
        raw["engine"]["lmcache"][key] = value
        config.write_text(yaml.safe_dump(raw))
        assert render(files, capsys, "--check")[0] == 1  # the manifest is out of date on the lmcache change alone
        assert render(files, capsys) == (0, "")
        after = _digests(manifest)
        assert len(set(after.values())) == 1 and set(after.values()).isdisjoint(before.values()), key
        cluster_after = yaml.safe_load(manifest.read_text())["spec"]["rayClusterConfig"]
        for template in [cluster_after["headGroupSpec"]["template"]] + [
            g["template"] for g in cluster_after["workerGroupSpecs"]
        ]:
            template["metadata"]["annotations"][ANNOTATION] = before["head"]
        assert cluster_after == cluster_before  # nothing else of the cluster changed
        raw["engine"]["lmcache"][key] = original
        config.write_text(yaml.safe_dump(raw))
        assert render(files, capsys) == (0, "")
        assert _digests(manifest) == before  # the same settings, the same digest
    # a setting of the engine that its node's server is not made from changes no pod template
    raw = yaml.safe_load(config.read_text())
    raw["engine"]["max_model_len"] = 16384
    config.write_text(yaml.safe_dump(raw))
    assert render(files, capsys) == (0, "")
    assert _digests(manifest) == before


def test_render_keeps_the_annotations_comments(files, capsys):
    manifest = files[1]
    assert render(files, capsys) == (0, "")
    text = manifest.read_text()
    assert text.count(f"{ANNOTATION}: ") == 2
    assert "# written by `kvmesh k8s render`, as on the head" in text


def test_render_refuses_a_ray_pod_template_without_the_node_server_annotation(files, capsys):
    manifest = files[1]
    lines = manifest.read_text().splitlines(keepends=True)
    worker = [i for i, line in enumerate(lines) if ANNOTATION in line][-1]
    del lines[worker - 1 : worker + 1]  # the worker group's `annotations:` and its one entry
    manifest.write_text("".join(lines))
    err = refused(files, capsys)
    assert "pod template of gpu-engines has no annotation kvmesh.io/node-server-config" in err


@pytest.mark.parametrize("value", [None, '"1"'], ids=["unset", "other-value"])
def test_render_refuses_ray_containers_that_disagree_on_the_serve_proxy(files, capsys, value):
    """Flipping Serve's HAProxy mode means changing it on the head and on the workers: a worker left unset or
    set otherwise is refused, not rendered."""
    manifest = files[1]
    lines = manifest.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if "- name: RAY_SERVE_ENABLE_HA_PROXY" in line][-1]  # the worker's
    if value is None:
        del lines[at : at + 2]
    else:
        lines[at + 1] = lines[at + 1].replace('"0"', value)
    manifest.write_text("".join(lines))
    err = refused(files, capsys)
    assert "must all set RAY_SERVE_ENABLE_HA_PROXY to the same value" in err and "gpu-engines" in err


def test_every_ray_container_of_the_repositorys_manifest_sets_the_serve_proxy():
    for name, template in _templates(K8S / "rayservice.yaml").items():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "0", name


def test_the_rayservice_rolls_a_new_cluster_on_a_cluster_spec_change():
    """Set in the manifest, not left to the operator's ENABLE_ZERO_DOWNTIME (KubeRay v1.7.0
    isZeroDowntimeUpgradeEnabled: spec.upgradeStrategy.type takes precedence)."""
    service = yaml.safe_load((K8S / "rayservice.yaml").read_text())
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}

"""A deployment started on the examples' published values refuses to start: the channel secret's
placeholder (k8s/secrets.example.yaml) and the API keys whose digests k8s/tenants-secret.example.yaml
publishes. The Kubernetes quick start (docs/kubernetes.md) makes its own secrets instead of applying those."""

from __future__ import annotations

import re

import pytest
import yaml
from paths import REPO_ROOT

from kvmesh.cluster.secure_channel import ChannelError, ChannelKeys, channel_keys
from kvmesh.deployments.tenants import ConfigError, TenantRegistry, hash_api_key, new_api_key

K8S = REPO_ROOT / "k8s"
SECRET = "a-salt-secret-for-tests-0123456789"


def _example_secrets() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((K8S / "secrets.example.yaml").read_text()))
    return {d["metadata"]["name"]: d for d in docs if d}


def _example_tenants() -> dict:
    secret = yaml.safe_load((K8S / "tenants-secret.example.yaml").read_text())
    return yaml.safe_load(secret["stringData"]["tenants.yaml"])


def _published_digests() -> list[tuple[str, str]]:
    """(tenant id, digest) of every key the example tenants Secret lists."""
    return [(t["id"], k["sha256"]) for t in _example_tenants()["tenants"] for k in t["keys"]]


def test_the_channel_secret_refuses_the_examples_placeholder(tmp_path):
    placeholder = _example_secrets()["kvmesh-channel-secret"]["stringData"]["secret"]
    path = tmp_path / "secret"
    path.write_text(placeholder + "\n")  # as a mounted Secret holds it
    with pytest.raises(ChannelError, match=r"placeholder \(REPLACE-\.\.\.\).*openssl rand -hex 32"):
        channel_keys(path)
    with pytest.raises(ChannelError, match="placeholder"):
        ChannelKeys.from_secret(b"REPLACE-ME-WITH-SOMETHING-LONG-ENOUGH")


def test_a_random_channel_secret_gives_keys(tmp_path):
    path = tmp_path / "secret"
    path.write_text("9f" * 32)  # what `openssl rand -hex 32` prints
    assert channel_keys(path) == ChannelKeys.from_secret(b"9f" * 32)


def test_the_example_tenants_secret_is_refused_naming_its_first_tenant(tmp_path):
    path = tmp_path / "tenants.yaml"  # where the Secret's tenants.yaml key lands in the pods
    path.write_text(yaml.safe_dump(_example_tenants()))
    with pytest.raises(ConfigError, match=r"tenant 'acme' has a key published in kvmesh's examples.*new-key"):
        TenantRegistry.from_file(path, secret=SECRET)


@pytest.mark.parametrize(("tenant", "digest"), _published_digests())
def test_each_published_key_is_refused_beside_fresh_ones(tmp_path, tenant, digest):
    own = {"id": "own", "keys": [{"sha256": hash_api_key(new_api_key())}]}
    published = {"id": tenant, "keys": [{"sha256": digest.upper()}]}  # digests match in either case
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [own, published]}))
    with pytest.raises(ConfigError, match=f"tenant '{tenant}' has a key published"):
        TenantRegistry.from_file(path, secret=SECRET)


def test_a_tenants_file_of_fresh_keys_loads(tmp_path):
    key = new_api_key()
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"id": "acme", "keys": [{"sha256": hash_api_key(key)}]}]}))
    assert TenantRegistry.from_file(path, secret=SECRET).authenticate(f"Bearer {key}").id == "acme"


def _quick_start() -> str:
    """The commands of docs/kubernetes.md's first code block."""
    text = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    return text.split("```")[1]


def test_the_quick_start_applies_no_example_secret():
    assert not re.search(r"\S+\.example\.yaml", _quick_start())


def secret_names(node) -> set[str]:
    """Names of the Secrets a manifest's pods mount (secretName) or read values from (secretKeyRef)."""
    names: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("secretName"), str):
            names.add(node["secretName"])
        if isinstance(node.get("secretKeyRef"), dict):
            names.add(node["secretKeyRef"]["name"])
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            names |= secret_names(item)
    return names


def test_the_quick_start_creates_every_secret_the_pods_read_from_random_bytes():
    text = _quick_start()
    docs = [d for name in ("rayservice.yaml", "valkey.yaml") for d in yaml.safe_load_all((K8S / name).read_text())]
    referenced = secret_names(docs)
    assert referenced == {"kvmesh-tenants", "kvmesh-salt-secret", "kvmesh-channel-secret", "kvmesh-valkey-password"}
    for name in sorted(referenced):
        assert f"kubectl create secret generic {name}" in text, name
    for name in sorted(referenced - {"kvmesh-tenants"}):
        line = next(line for line in text.splitlines() if f"kubectl create secret generic {name}" in line)
        assert "$(openssl rand -hex 32)" in line, line
    assert "python -m kvmesh.deployments.tenants new-key" in text  # the tenants file gets fresh keys


def test_a_pods_salt_secret_file_holding_the_examples_placeholder_stops_the_ingress(tmp_path):
    """On KubeRay the secret file exists only in the pods, where the ingress reads it."""
    from kvmesh.deployments.config import ConfigError
    from kvmesh.deployments.tenants import resolve_secret

    path = tmp_path / "secret"
    path.write_text("REPLACE-WITH-32-RANDOM-BYTES-HEX\n")
    with pytest.raises(ConfigError, match="placeholder"):
        resolve_secret(env={"KVMESH_SALT_SECRET_FILE": str(path)})
    path.write_text("a" * 64)
    assert resolve_secret(env={"KVMESH_SALT_SECRET_FILE": str(path)}) == b"a" * 64

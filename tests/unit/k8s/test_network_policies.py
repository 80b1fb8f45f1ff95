"""Offline checks of k8s/networkpolicies.yaml and the secrets behind the channels it leaves open.

Structure: a strict schema of networking.k8s.io/v1 NetworkPolicy (the fields of the Kubernetes API
reference; an unknown key is an error, as `kubectl --validate=strict` would say). Meaning: the pods'
labels are read from the manifests (the pod templates plus the labels KubeRay adds to every Ray pod:
ray.io/is-ray-node, ray.io/node-type, ray.io/group), and who may connect to whom on which port is
worked out with NetworkPolicy's own rules (a pod selected by some policy accepts only what one of
them allows; `from` peers are ORed, the labels inside one selector ANDed; a peer without a
namespaceSelector means the policy's own namespace, kvmesh's).
"""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from paths import REPO_ROOT

K8S = REPO_ROOT / "k8s"

_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_PEER = {
    "type": "object",
    "additionalProperties": False,
    "minProperties": 1,
    "properties": {
        "podSelector": _SELECTOR,
        "namespaceSelector": _SELECTOR,
        "ipBlock": {
            "type": "object",
            "additionalProperties": False,
            "required": ["cidr"],
            "properties": {"cidr": {"type": "string"}, "except": {"type": "array", "items": {"type": "string"}}},
        },
    },
}
_PORT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
        "port": {"type": ["integer", "string"]},
        "endPort": {"type": "integer"},
    },
}
NETWORK_POLICY_V1 = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"},
        "kind": {"const": "NetworkPolicy"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": {"type": "object"}, "namespace": {"type": "string"}},
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["podSelector"],
            "properties": {
                "podSelector": _SELECTOR,
                "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                "ingress": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "from": {"type": "array", "items": _PEER},
                            "ports": {"type": "array", "items": _PORT},
                        },
                    },
                },
                "egress": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "to": {"type": "array", "items": _PEER},
                            "ports": {"type": "array", "items": _PORT},
                        },
                    },
                },
            },
        },
    },
}


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def policies() -> list[dict]:
    return [d for d in _docs("networkpolicies.yaml") if d.get("kind") == "NetworkPolicy"]


def pod_labels() -> dict[str, dict[str, str]]:
    """Labels of each kind of pod the manifests create, KubeRay's own included."""
    svc = next(d for d in _docs("rayservice.yaml") if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    ray = {"ray.io/is-ray-node": "yes"}
    head = svc["headGroupSpec"]["template"].get("metadata", {}).get("labels", {})
    pods = {"head": {**head, **ray, "ray.io/node-type": "head", "ray.io/group": "headgroup"}}
    for g in svc["workerGroupSpecs"]:
        labels = g["template"].get("metadata", {}).get("labels", {})
        pods[g["groupName"]] = {**labels, **ray, "ray.io/node-type": "worker", "ray.io/group": g["groupName"]}
    valkey = next(d for d in _docs("valkey.yaml") if d["kind"] == "Deployment")
    pods["valkey"] = valkey["spec"]["template"]["metadata"]["labels"]
    pods["http-front"] = {"kvmesh.io/http-front": "true", "app": "gateway"}
    pods["prometheus"] = {"app.kubernetes.io/name": "prometheus"}
    pods["other-workload"] = {"app": "someone-elses-job"}
    # KubeRay v1.7.0's operator pod as its Helm chart and as its kustomize config (ray-operator/config) label it
    pods["kuberay-operator"] = {
        "app.kubernetes.io/name": "kuberay-operator",
        "app.kubernetes.io/instance": "kuberay-operator",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    pods["kuberay-operator-kustomize"] = {
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/component": "kuberay-operator",
    }
    pods["operator-lookalike"] = dict(pods["kuberay-operator"])  # the same labels, in another namespace
    return pods


KVMESH_NAMESPACE = "kvmesh"
# the namespace of each pod kvmesh does not create (kvmesh's own pods live in KVMESH_NAMESPACE)
NAMESPACES = {
    "http-front": "ingress-nginx",
    "prometheus": "monitoring",
    "other-workload": "someone-else",
    "kuberay-operator": "default",  # where KubeRay's Helm chart and kustomize config install it
    "kuberay-operator-kustomize": "default",
    "operator-lookalike": "someone-else",
}


def namespace_labels(pod: str) -> dict[str, str]:
    """The labels Kubernetes gives every namespace: its name."""
    return {"kubernetes.io/metadata.name": NAMESPACES.get(pod, KVMESH_NAMESPACE)}


def _matches(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions"), "extend _matches before using matchExpressions"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_allows(peer: dict, src: str) -> bool:
    # a peer without namespaceSelector means "pods of the policy's namespace" (kvmesh's); with
    # `namespaceSelector: {}` any namespace
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        in_namespace = _matches(peer["namespaceSelector"], namespace_labels(src))
    else:
        in_namespace = namespace_labels(src) == namespace_labels("head")
    return in_namespace and _matches(peer.get("podSelector", {}), pod_labels()[src])


def allowed(src: str, dst: str, port: int) -> bool:
    pods = pod_labels()
    selecting = [p for p in policies() if _matches(p["spec"]["podSelector"], pods[dst])]
    if not selecting:
        return True  # no policy selects the pod: Kubernetes lets everything in
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(q.get("port") == port for q in ports):
                continue
            if any(_peer_allows(peer, src) for peer in rule.get("from", [{}])):
                return True
    return False


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p["metadata"]["name"])
def test_each_policy_is_a_valid_ingress_network_policy_that_selects_pods(policy):
    jsonschema.validate(policy, NETWORK_POLICY_V1)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert any(_matches(policy["spec"]["podSelector"], labels) for labels in pod_labels().values())


def test_the_policies_are_deployed_with_the_rest():
    assert "networkpolicies.yaml" in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert {"head", "gpu-engines", "valkey"} <= set(pod_labels())  # the pods the policies are written for


ENGINE_EVENT_PORT = 41234  # the relay binds a random port: any port on a GPU worker stands for it


@pytest.mark.parametrize(
    ("src", "dst", "port", "ok"),
    [
        # the HTTP front reaches the Serve port on the head, and nothing else
        ("http-front", "head", 8000, True),
        ("http-front", "head", 6379, False),  # the GCS
        ("http-front", "head", 8265, False),  # the dashboard
        ("http-front", "gpu-engines", ENGINE_EVENT_PORT, False),
        ("other-workload", "head", 8000, False),
        # engine event and replay ports: kvmesh's Ray pods only (the routers live in Ingress replicas there)
        ("head", "gpu-engines", ENGINE_EVENT_PORT, True),
        ("gpu-engines", "gpu-engines", ENGINE_EVENT_PORT, True),
        ("other-workload", "gpu-engines", ENGINE_EVENT_PORT, False),
        ("valkey", "gpu-engines", ENGINE_EVENT_PORT, False),
        # the shared KV tier: the engines' LMCache servers only
        ("gpu-engines", "valkey", 6379, True),
        ("head", "valkey", 6379, False),
        ("other-workload", "valkey", 6379, False),
        ("http-front", "valkey", 6379, False),
        # metrics scrapes
        ("prometheus", "gpu-engines", 8080, True),
        ("prometheus", "gpu-engines", ENGINE_EVENT_PORT, False),
        ("prometheus", "head", 8000, True),
        ("prometheus", "valkey", 6379, False),
        # the KubeRay operator deploys serveConfigV2 through the dashboard and checks the head's Serve proxy
        ("kuberay-operator", "head", 8265, True),
        ("kuberay-operator", "head", 8000, True),
        ("kuberay-operator-kustomize", "head", 8265, True),
        ("kuberay-operator-kustomize", "head", 8000, True),
        ("kuberay-operator", "head", 6379, False),
        ("kuberay-operator", "head", 10001, False),  # the Ray client port
        ("kuberay-operator", "gpu-engines", ENGINE_EVENT_PORT, False),
        ("kuberay-operator", "valkey", 6379, False),
        # the operator's labels from another namespace: the dashboard would run anything it is sent
        ("operator-lookalike", "head", 8265, False),
        ("operator-lookalike", "head", 8000, False),
    ],
)
def test_who_may_connect_where(src, dst, port, ok):
    assert allowed(src, dst, port) is ok


def test_every_ray_pod_reads_the_channel_secret_from_a_file():
    """Engines serve their KV-event relays and routers (on any Ray pod) subscribe with keys from it."""
    svc = next(d for d in _docs("rayservice.yaml") if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    pods = [svc["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in svc["workerGroupSpecs"]]
    for pod in pods:
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        path = env["KVMESH_CHANNEL_SECRET_FILE"]["value"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert path.startswith(mounts["channel"] + "/")
        assert vols["channel"]["secret"]["secretName"] == "kvmesh-channel-secret"
        mode = vols["channel"]["secret"]["defaultMode"]
        # the Ray processes (uid 1000, group 100 of the rayproject/ray image) read it through the pod's
        # fsGroup; no one else in the container may
        assert mode & 0o040 and not mode & 0o007, oct(mode)
        assert pod["securityContext"]["fsGroup"] == 100


def test_valkey_requires_the_password_the_engines_send():
    valkey = next(d for d in _docs("valkey.yaml") if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = valkey["containers"]
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(VALKEY_PASSWORD)"
    ref = {e["name"]: e for e in container["env"]}["VALKEY_PASSWORD"]["valueFrom"]["secretKeyRef"]
    svc = next(d for d in _docs("rayservice.yaml") if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    for group in svc["workerGroupSpecs"]:  # the engines' LMCache servers run here
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["LMCACHE_RESP_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    secrets = {d["metadata"]["name"]: d for d in _docs("secrets.example.yaml")}
    assert ref["key"] in secrets[ref["name"]]["stringData"] and "kvmesh-channel-secret" in secrets

"""Which Ray pods of the RayService become Ready, and which receive Serve traffic, under KubeRay v1.7.0.

The model follows KubeRay v1.7.0's source: `initLivenessAndReadinessProbe` (ray-operator/controllers/ray/
common/pod.go) fills in a probe only where the container has none; for Ray >= 2.53 it is an HTTP check of
the dashboard agent's /api/healthz, except a RayService worker's readiness, which becomes
`wget ... localhost:52365/api/local_raylet_healthz ... && wget ... localhost:<serve port>/-/healthz`. BuildPod
labels every RayService worker ray.io/serve=true, so its serve Service (`BuildServeService`, whose ports a
spec.serveService port of the same name replaces) sends traffic to each Ready worker that resolves the
port's targetPort. With proxy_location HeadOnly only the head listens on the serve port.
"""

from __future__ import annotations

import re

import pytest
import yaml
from paths import REPO_ROOT

MANIFEST = REPO_ROOT / "k8s" / "rayservice.yaml"
AGENT_PORT = 52365  # KubeRay's DefaultDashboardAgentListenPort
SERVE_PORT = 8000  # KubeRay's DefaultServingPort


@pytest.fixture
def service() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _serve_port(container: dict) -> int:
    return next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == "serve"), SERVE_PORT)


def effective_probes(container: dict, params: dict, node_type: str) -> dict[str, dict]:
    """{"readiness": probe, "liveness": probe} as KubeRay v1.7.0 leaves a RayService pod's Ray container."""
    agent = int(params.get("dashboard-agent-listen-port", AGENT_PORT))
    unified = {"httpGet": {"path": "/api/healthz", "port": agent}}
    readiness = container.get("readinessProbe")
    if readiness is None:
        readiness = unified
        if node_type == "worker":
            raylet = f"wget --tries 1 -T 2 -q -O- http://localhost:{agent}/api/local_raylet_healthz | grep success"
            proxy = f"wget --tries 1 -T 10 -q -O- http://localhost:{_serve_port(container)}/-/healthz | grep success"
            readiness = {"exec": {"command": ["bash", "-c", f"{raylet} && {proxy}"]}}
    return {"readiness": readiness, "liveness": container.get("livenessProbe") or unified}


def checked_ports(probe: dict) -> set[int]:
    """The local ports a probe must reach for it to pass."""
    if "httpGet" in probe:
        return {int(probe["httpGet"]["port"])}
    if "tcpSocket" in probe:
        return {int(probe["tcpSocket"]["port"])}
    return {int(port) for port in re.findall(r"localhost:(\d+)/", " ".join(probe["exec"]["command"]))}


def pods(service: dict) -> list[tuple[str, str, dict, dict]]:
    """(group, node type, Ray container, rayStartParams) of every pod group."""
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    out = [("head", "head", head["template"]["spec"]["containers"][0], head.get("rayStartParams") or {})]
    for g in cluster["workerGroupSpecs"]:
        out.append((g["groupName"], "worker", g["template"]["spec"]["containers"][0], g.get("rayStartParams") or {}))
    return out


def listening_ports(service: dict, node_type: str, container: dict, params: dict) -> set[int]:
    """What answers inside a healthy pod: the dashboard agent, and the Serve proxy where Serve runs one."""
    proxy_location = yaml.safe_load(service["spec"]["serveConfigV2"]).get("proxy_location", "EveryNode")
    ports = {int(params.get("dashboard-agent-listen-port", AGENT_PORT))}
    if node_type == "head" or proxy_location == "EveryNode":
        ports.add(_serve_port(container))
    return ports


def ready(service: dict, node_type: str, container: dict, params: dict) -> bool:
    probe = effective_probes(container, params, node_type)["readiness"]
    return checked_ports(probe) <= listening_ports(service, node_type, container, params)


def routable(service: dict, container: dict) -> bool:
    """Whether the serve Service resolves a (selected, Ready) pod's target port: a named targetPort only on
    a pod with a container port of that name; a number, or none (the service port), on every pod."""
    custom = {p["name"]: p for p in ((service["spec"].get("serveService") or {}).get("spec") or {}).get("ports") or []}
    target = custom.get("serve", {}).get("targetPort", SERVE_PORT)
    if isinstance(target, str):
        return any(p.get("name") == target for p in container.get("ports") or [])
    return True


def test_the_serve_config_keeps_the_proxy_on_the_head(service):
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"


def test_every_healthy_worker_becomes_ready(service):
    """A worker's readiness must not wait for a Serve proxy that HeadOnly never starts there."""
    workers = [(g, c, p) for g, kind, c, p in pods(service) if kind == "worker"]
    assert workers
    for group, container, params in workers:
        assert ready(service, "worker", container, params), f"{group} would never be Ready"
        probes = effective_probes(container, params, "worker")
        assert checked_ports(probes["liveness"]) == {AGENT_PORT}  # a worker without a proxy stays alive


def test_only_pods_with_a_serve_proxy_receive_serve_traffic(service):
    for group, kind, container, params in pods(service):
        serves = SERVE_PORT in listening_ports(service, kind, container, params)
        gets_traffic = kind == "worker" and ready(service, kind, container, params) and routable(service, container)
        assert not gets_traffic or serves, f"the serve Service would send requests to {group}'s empty port 8000"
    head = pods(service)[0][2]
    assert routable(service, head)  # the head, once KubeRay finds its proxy healthy


def test_the_model_sees_kuberays_own_readiness_check_on_a_worker():
    """The model itself: a worker container without a readinessProbe gets KubeRay's serve-proxy check."""
    probes = effective_probes({"name": "ray-worker"}, {}, "worker")
    assert checked_ports(probes["readiness"]) == {AGENT_PORT, SERVE_PORT}
    assert checked_ports(effective_probes({}, {}, "head")["readiness"]) == {AGENT_PORT}

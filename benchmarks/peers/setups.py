"""The peer routers as they ship (PyPI `bench` extra), started in front of the same vLLM servers.

Only what a user must set to make a policy work at all is set: ports, worker URLs, and for
vllm-router's kv_aware the event sources with the engines' real block size (its default, 16, never
matches a 32-token engine: docs/peers.md). Everything else (thresholds, balance knobs) is the peer's
default, so the comparison is against the product as shipped.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmesh.benchmarks.peers import procs
from kvmesh.benchmarks.peers.engines import SERVED_MODEL_NAME, EngineSpec, VllmServer
from kvmesh.cluster.ports import free_port

KVMESH = "kvmesh"


@dataclass(frozen=True)
class PeerSetup:
    name: str  # e.g. "vllm-router/kv_aware"
    router: str  # "vllm-router" | "sglang-router"
    policy: str
    # prompt forms the peer is known not to take (it fails every such request); only these are exempt from
    # the target that every peer answers every request (`results.check_targets`)
    unsupported_forms: tuple[str, ...] = ()


PEER_SETUPS = [
    PeerSetup("vllm-router/round_robin", "vllm-router", "round_robin"),
    PeerSetup("vllm-router/cache_aware", "vllm-router", "cache_aware"),
    PeerSetup("vllm-router/kv_aware", "vllm-router", "kv_aware"),
    # sglang-router 0.3.2 answers HTTP 422 to a token-id prompt (docs/peers.md)
    PeerSetup("sglang-router/cache_aware", "sglang-router", "cache_aware", unsupported_forms=("tokens",)),
]
SETUP_NAMES = [s.name for s in PEER_SETUPS] + [KVMESH]
UNSUPPORTED_FORMS = {s.name: s.unsupported_forms for s in PEER_SETUPS if s.unsupported_forms}


def router_binary(name: str) -> str:
    """The console script next to this interpreter (the venv), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not installed (pip install -e '.[bench]')")
    return found


def router_command(
    setup: PeerSetup, servers: list[VllmServer], spec: EngineSpec, port: int, metrics_port: int
) -> list[str]:
    urls = [s.url for s in servers]
    if setup.router == "vllm-router":
        cmd = [
            router_binary("vllm-router"),
            "--worker-urls",
            *urls,
            "--policy",
            setup.policy,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warning",
        ]
        if setup.policy == "kv_aware":
            for s in servers:
                cmd += ["--kv-event-source", f"{s.url}={s.kv_endpoint}"]
            cmd += ["--kv-event-block-size", str(spec.block_size), "--kv-event-model", SERVED_MODEL_NAME]
        return cmd
    if setup.router == "sglang-router":
        return [
            router_binary("sglang-router"),
            "launch",
            "--worker-urls",
            *urls,
            "--policy",
            setup.policy,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warn",
        ]
    raise ValueError(f"unknown router {setup.router}")


def start_router(
    setup: PeerSetup, servers: list[VllmServer], spec: EngineSpec, log_dir: Path, deadline_s: float = 120.0
) -> tuple[procs.Proc, str, str]:
    """Start the peer; return (process, base URL, its Prometheus URL) once /health answers."""
    port, mport = free_port(), free_port()
    proc = procs.start(setup.name.replace("/", "-"), router_command(setup, servers, spec, port, mport), log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_ready([proc], [url + "/health"], deadline_s)
    except Exception:
        proc.stop()
        raise
    return proc, url, f"http://127.0.0.1:{mport}/metrics"

"""N identical vLLM OpenAI servers for the peer benchmark. Identical means: same model files, block
size, KV space, prefix-cache hash algorithm, seed and KV-event publisher settings; only the ports
differ. Each server publishes KV events (which carry the prompts' token ids). By default the publisher
binds a unix socket in a 0700 folder: nothing reads the events but a subscriber of this user. A peer
that subscribes itself (vllm-router's kv_aware) accepts only a `tcp://HOST:PORT` source, and vLLM's
publisher binds only for an endpoint with `*` or `::` in it (it connects otherwise), so `kv_events_tcp=True`
binds `tcp://[::ffff:127.0.0.1]:P`: the IPv4-mapped form of loopback, which has the `::` vLLM looks for and
which ZeroMQ binds as 127.0.0.1 (`tcp_kv_endpoints`). The events stay in plaintext, on loopback only,
where the peers (on this machine) subscribe."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.benchmarks.peers import procs
from kvmesh.cluster.ports import free_port
from kvmesh.deployments.config import engine_dtype

SERVED_MODEL_NAME = "tiny"


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings shared by every server of one run (and by `kvmesh serve` in the same run)."""

    model: str
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 32
    kv_cache_space_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    hash_algo: str = "sha256"
    seed: int = 0
    omp_threads: int = 1  # 2 shared cores: one thread per server keeps N servers from thrashing
    in_process_engine: bool = True  # VLLM_ENABLE_V1_MULTIPROCESSING=0: ~1 GB and ~15 s less per server
    kv_topic: str = ""  # vLLM's default; vllm-router 0.1.17's static sources subscribe to "" only

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def kvmesh_engine_config(self) -> dict:
        """The same settings in `kvmesh serve`'s engine config (deployments/config.py)."""
        return {
            "model": self.model,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "kv_cache_space_gb": self.kv_cache_space_gb,
            "hash_algo": self.hash_algo,
            "seed": self.seed,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": True,
        }


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT
    kv_endpoint: str  # where a subscriber connects: ipc://DIR/kv, or tcp://127.0.0.1:ZPORT
    topic: str
    proc: procs.Proc = field(repr=False)
    # the server's 0700 folder, removed with it: its KV-event socket (unless on TCP) and vLLM's own IPC
    # sockets (VLLM_RPC_BASE_PATH) and file store (TMPDIR), which vLLM leaves behind in /tmp otherwise
    private_dir: str | None = None


def tcp_kv_endpoints(port: int) -> tuple[str, str]:
    """(where a server's KV-event publisher binds, where a subscriber connects) for TCP `port`, on loopback.
    Why the mapped form: with plain `tcp://127.0.0.1:P` vLLM's publisher would connect instead of binding,
    and `tcp://*:P` binds every interface."""
    return f"tcp://[::ffff:127.0.0.1]:{port}", f"tcp://127.0.0.1:{port}"


def server_command(spec: EngineSpec, port: int, kv_bind: str, topic: str) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_bind,
        "topic": topic,
    }
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(spec.block_size),
        "--max-model-len",
        str(spec.max_model_len),
        "--dtype",
        engine_dtype(spec.model, "auto"),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        spec.hash_algo,
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events),
        "--enforce-eager",
        "--seed",
        str(spec.seed),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--uvicorn-log-level",
        "warning",
    ]


def start_servers(
    n: int, spec: EngineSpec, work_dir: Path, deadline_s: float = 600.0, kv_events_tcp: bool = False
) -> list[VllmServer]:
    """Cold-start `n` servers and wait until all answer /health. Stops them all if any fails.
    `kv_events_tcp`: publish KV events on TCP (loopback) for a peer that subscribes over TCP;
    otherwise on a private unix socket."""
    servers: list[VllmServer] = []
    private_dir = None
    try:
        for i in range(n):
            port = free_port()
            # mkdtemp is 0700; /tmp keeps the socket paths within ipc's ~107 bytes
            private_dir = tempfile.mkdtemp(prefix="kvmesh-peer-", dir="/tmp")
            if kv_events_tcp:
                kv_port = free_port()
                kv_bind, kv_endpoint = tcp_kv_endpoints(kv_port)
            else:
                kv_bind = kv_endpoint = f"ipc://{private_dir}/kv"
            topic = spec.kv_topic
            env = {
                "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_space_gb),
                "VLLM_CACHE_ROOT": str(work_dir / f"vllm-cache-{i}"),
                "OMP_NUM_THREADS": str(spec.omp_threads),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if spec.in_process_engine else "1",
                "VLLM_RPC_BASE_PATH": private_dir,
                "TMPDIR": private_dir,  # and its torch.distributed file store (vllm_dist_*), made in the temp folder
            }
            proc = procs.start(f"vllm-{i}", server_command(spec, port, kv_bind, topic), work_dir / "logs", env)
            servers.append(VllmServer(f"http://127.0.0.1:{port}", kv_endpoint, topic, proc, private_dir))
            private_dir = None  # the server owns it now
        procs.wait_ready([s.proc for s in servers], [s.url + "/health" for s in servers], deadline_s)
        # /health can answer a moment before the model endpoint does
        procs.wait_ready([s.proc for s in servers], [s.url + "/v1/models" for s in servers], 60)
    except BaseException:  # a failed start, a server that never answers, or an interrupt: none left behind
        stop_servers(servers)
        if private_dir:
            shutil.rmtree(private_dir, ignore_errors=True)
        raise
    return servers


def stop_servers(servers: list[VllmServer]) -> None:
    procs.stop_all([s.proc for s in servers])
    for s in servers:
        if s.private_dir:
            shutil.rmtree(s.private_dir, ignore_errors=True)

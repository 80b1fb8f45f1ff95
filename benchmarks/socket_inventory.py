"""List every listening socket of a local `kvmesh serve` and its whole process tree (docs/security.md).

Starts `kvmesh serve` (tiny model, LMCache host tier on) on a free port, waits until it answers, lists the
TCP sockets in LISTEN state and the UDP sockets of the serve process and every descendant (psutil), then
stops it with SIGINT. Rerun it after any change that opens or moves a socket:

    .venv/bin/python -m kvmesh.benchmarks.socket_inventory [--json FILE]
    .venv/bin/python -m kvmesh.benchmarks.socket_inventory --engine   # one engine replica, no Ray (~10 s)

Exit status 1 when a socket is bound to a non-loopback address, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

LOOPBACK = ("127.", "::1", "::ffff:127.")  # IPv4-mapped loopback: Ray binds its node address as "::ffff:127.0.0.1"
API_KEY = "kvm-socket-inventory-0123456789"
SERVE_CONFIG = """\
replicas: 2
engine:
  model: tiny
  block_size: 32
  max_model_len: 2048
  num_gpu_blocks_override: 512
  lmcache: {l1_size_gb: 0.2, l2: none, chunk_size: 256}
"""


def listening_sockets(root_pid: int) -> list[dict]:
    """Listening TCP and bound UDP sockets of `root_pid` and all its descendants, one row per socket."""
    import psutil  # type: ignore[import-untyped,unused-ignore]

    root = psutil.Process(root_pid)
    rows = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name()
            cmd = " ".join(proc.cmdline()[:3])[:80]
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            udp = c.type == 2  # socket.SOCK_DGRAM
            if not udp and c.status != psutil.CONN_LISTEN:
                continue
            rows.append(
                {
                    "pid": proc.pid,
                    "process": name,
                    "cmdline": cmd,
                    "proto": "udp" if udp else "tcp",
                    "address": c.laddr.ip,
                    "port": c.laddr.port,
                    "loopback": c.laddr.ip.startswith(LOOPBACK),
                }
            )
    return sorted(rows, key=lambda r: (r["process"], r["port"]))


def _wait_serving(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until a completion comes back: then every engine and the LMCache server are up."""
    body = json.dumps({"model": "tiny", "prompt": "socket inventory", "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvmesh serve exited with status {proc.returncode}")
        try:
            req = urllib.request.Request(f"{base}/v1/completions", data=body, headers=headers)
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base} not serving after {timeout_s:.0f} s")


def measure(timeout_s: float = 600) -> list[dict]:
    from kvmesh.cluster.ports import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvmesh-inventory-") as tmp:
        cfg = Path(tmp) / "serve.yaml"
        cfg.write_text(SERVE_CONFIG)
        env = {**os.environ, "KVMESH_HOME": os.environ.get("KVMESH_HOME") or str(Path(tmp) / "home")}
        cmd = [sys.executable, "-m", "kvmesh.deployments.cli", "serve", "--config", str(cfg), "--port", str(port)]
        cmd += ["--api-key", API_KEY, "--num-cpus", "4"]  # headroom for the LMCache node actor beside two engines
        log = open(Path(tmp) / "serve.log", "wb")  # noqa: SIM115 (closed below, after the process)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                _wait_serving(f"http://127.0.0.1:{port}", proc, timeout_s)
            except Exception:
                sys.stderr.write((Path(tmp) / "serve.log").read_text(errors="replace")[-3000:])
                raise
            time.sleep(2.0)
            return listening_sockets(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


def measure_engine() -> list[dict]:
    """What one EngineReplica (real vLLM engine, KV events on, in this process, no Ray) adds: its listeners,
    and vLLM's own publisher, which must be unix sockets in an owner-only folder."""
    import psutil  # type: ignore[import-untyped,unused-ignore]

    from kvmesh.cluster.secure_channel import CHANNEL_SECRET_FILE_ENV, write_channel_secret

    def listening() -> set[tuple[str, int]]:
        conns = psutil.Process().net_connections(kind="inet")
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}

    # a channel secret of its own where none is given: its folder and the variable go again at the end
    secret_dir = None
    if not os.environ.get(CHANNEL_SECRET_FILE_ENV):
        secret_dir = tempfile.mkdtemp(prefix="kvmesh-inventory-")
        os.environ[CHANNEL_SECRET_FILE_ENV] = str(write_channel_secret(secret_dir))
    try:
        return _engine_rows(listening)
    finally:
        if secret_dir is not None:
            os.environ.pop(CHANNEL_SECRET_FILE_ENV, None)
            shutil.rmtree(secret_dir, ignore_errors=True)


def _engine_rows(listening: Callable[[], set[tuple[str, int]]]) -> list[dict]:
    """The listeners and vLLM publisher sockets one EngineReplica adds (measure_engine)."""
    before = listening()
    from kvmesh.deployments.engine import EngineReplica

    replica = EngineReplica({"model": "tiny", "num_gpu_blocks_override": 64, "max_model_len": 512})
    try:
        advertised = {replica.kv_events_endpoint, replica.replay_endpoint}
        rows = []
        for ip, port in sorted(listening() - before):
            what = "KV-event relay (CURVE)" if any(e and e.endswith(f":{port}") for e in advertised) else "vLLM"
            rows.append(
                {
                    "pid": os.getpid(),
                    "process": "engine replica",
                    "cmdline": what,
                    "proto": "tcp",
                    "address": ip,
                    "port": port,
                    "loopback": ip.startswith(LOOPBACK),
                }
            )
        folder = replica._private_dir or ""
        mode = oct(os.stat(folder).st_mode & 0o777) if folder else "-"
        sockets = [e.name for e in os.scandir(folder) if stat.S_ISSOCK(e.stat().st_mode)] if folder else []
        for name in sorted(sockets):
            rows.append(
                {
                    "pid": os.getpid(),
                    "process": "engine replica",
                    "cmdline": f"vLLM publisher, folder {mode}",
                    "proto": "unix",
                    "address": f"{folder}/{name}",
                    "port": 0,
                    "loopback": True,
                }
            )
        return rows
    finally:
        replica.driver.shutdown()
        replica._release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--engine", action="store_true", help="one engine replica in this process instead")
    args = parser.parse_args(argv)
    rows = measure_engine() if args.engine else measure()
    for r in rows:
        print(f"{r['proto']:3} {r['address']:>15}:{r['port']:<5} {r['process']:<24} pid {r['pid']:<7} {r['cmdline']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    exposed = [r for r in rows if not r["loopback"]]
    print(f"{len(rows)} sockets, {len(exposed)} on a non-loopback address")
    return 1 if exposed else 0


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

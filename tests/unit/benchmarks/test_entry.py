"""Every benchmark run directly (`python -m kvmesh.benchmarks.<name>`) unwinds through its clean-up on SIGTERM,
as `make bench` and the CLI do: Python's default ended the process at once, leaving the Redis, LMCache
servers, engines and temporary folders it had started (benchmarks/entry.py)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmesh import benchmarks

# bench_tiers as `python -m` runs it, with its servers faked: the first one's launch waits for the SIGTERM
CHILD = textwrap.dedent(
    """
    import runpy, sys, time
    from kvmesh.kvstore import lmcache_server, redis_process

    class Redis:
        url = "redis://127.0.0.1:1"

        def __init__(self, root):
            print("folder", root.parent, flush=True)

        def start(self):
            return self

        def stop(self):
            print("redis stopped", flush=True)

    class Server:
        def __init__(self, config, log):
            pass

        def launch(self):
            print("launched", flush=True)
            time.sleep(60)

        def stop(self):
            print("server stopped", flush=True)

    redis_process.RedisServer = Redis
    lmcache_server.LMCacheServer = Server
    sys.argv = ["bench_tiers", "--model", "unused"]
    runpy.run_module("kvmesh.benchmarks.bench_tiers", run_name="__main__", alter_sys=True)
    """
)


def test_a_benchmark_run_directly_cleans_up_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "launched":
                break
        folder = next((x.removeprefix("folder ") for x in lines if x.startswith("folder ")), None)
        assert folder and os.path.isdir(folder), f"the bench did not start: {lines}, {proc.stderr.read()}"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, f"status {proc.returncode}: {err[-2000:]}"
    assert out.split().count("stopped") == 3, f"its servers were not stopped: {out!r}"
    assert not os.path.exists(folder), "its temporary folder was left behind"


def _main_blocks() -> dict[str, ast.If]:
    """Each benchmarks module's `if __name__ == "__main__":` block, by module name."""
    blocks = {}
    for path in sorted(Path(benchmarks.__path__[0]).glob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                blocks[path.stem] = node
    return blocks


def test_every_benchmark_module_run_directly_goes_through_run_main():
    blocks = _main_blocks()
    assert len(blocks) >= 20, sorted(blocks)
    calls = {
        name: {n.func.id for n in ast.walk(block) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        for name, block in blocks.items()
    }
    # run_all (`make bench`) unwinds inside its own main(), which tests call in their own process
    assert sorted(name for name, called in calls.items() if "run_main" not in called) == ["run_all"]


@pytest.mark.parametrize("returned, status", [(None, 0), (3, 3), ({"figure": 1.0}, 0)])
def test_run_main_exits_with_an_int_main_returns_and_0_for_figures(returned, status):
    from kvmesh.benchmarks.entry import run_main

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        run_main(lambda argv: returned, ["--flag"])
    assert info.value.code == status
    assert signal.getsignal(signal.SIGTERM) is before, "the caller's SIGTERM handler was not put back"

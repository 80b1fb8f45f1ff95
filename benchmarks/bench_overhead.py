"""kvmesh's per-request overhead against a bare vLLM server, with vllm-router round_robin as the peer
baseline, all on the same engine settings in one run (`benchmarks/peers/overhead.py`, what `kvmesh bench
overhead` runs): one client, 16 fresh random prompt tokens, `max_tokens` 1, p50 latency per path, the paths
interleaved one request each per round (a drifting machine then moves them alike).

Target: kvmesh's p50 at most OVERHEAD_MAX_MS above the bare server's. Part of `BENCH=scale` (GROUPS in
run_all.py). Writes BENCH_OUT/overhead/overhead.json. BENCH_OVERHEAD_REQUESTS sets the measured requests
per path (default 100). Exit 1 on a miss.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kvmesh.benchmarks.output import out_dir
from kvmesh.benchmarks.targets import Targets

WORKERS = 2
OVERHEAD_MAX_MS = 3.0


def main() -> None:
    from kvmesh.benchmarks.peers.engines import EngineSpec
    from kvmesh.benchmarks.peers.overhead import run_overhead
    from kvmesh.deployments.tiny_model import build_tiny_model

    targets = Targets()
    path = out_dir("overhead")
    requests = int(os.environ.get("BENCH_OVERHEAD_REQUESTS", "100"))
    # the tiny model's build, the servers' logs and Ray's session folder: removed when the bench ends
    work = Path(tempfile.mkdtemp(prefix="kvmesh-overhead-"))
    try:
        spec = EngineSpec(model=str(build_tiny_model(work / "tiny")))
        report = run_overhead(spec, work, workers=WORKERS, requests=requests)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    over = report["overhead_p50_ms"]
    print(
        f"\nper-request overhead over a bare vLLM server (p50, {requests} requests per path, one at a time, "
        f"interleaved; {WORKERS} engines):"
    )
    print(f"  bare vLLM server          {report['direct']['p50_ms']:6.2f} ms")
    print(f"  vllm-router round_robin   +{over['vllm-router/round_robin']:5.2f} ms")
    ok = over["kvmesh"] <= OVERHEAD_MAX_MS
    paired = report["overhead_paired_ms"]["kvmesh"]
    print(f"  kvmesh                    +{over['kvmesh']:5.2f} ms  (paired per round +{paired:.2f} ms)")
    print(f"  kvmesh p50 overhead target <= +{OVERHEAD_MAX_MS:.0f} ms: ", end="")
    print(targets.verdict(f"kvmesh overhead <= +{OVERHEAD_MAX_MS:.0f} ms", ok))
    with open(os.path.join(path, "overhead.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}/overhead.json")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

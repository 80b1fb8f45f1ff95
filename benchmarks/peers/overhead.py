"""Per-request overhead of kvmesh's serving path (HTTP proxy -> ingress -> router -> engine replica)
against vllm-router round_robin in front of plain vLLM OpenAI servers, with the same engine settings.

Short prompts (16 fresh random tokens, so no prefix cache), max_tokens=1, one request at a time:
end-to-end latency is then mostly path overhead plus one tiny prefill. Three paths are measured:
`direct` (client -> vLLM server), `vllm-router` (client -> router -> vLLM server) and `kvmesh`
(client -> Serve proxy -> ingress -> kvmesh router -> engine). Overheads are differences of medians
against `direct`. kvmesh's own routing decision time comes from its /metrics
(kvmesh_router_decision_seconds_total / kvmesh_router_decisions_total).
"""

from __future__ import annotations

import os
import random
import re
import secrets
import statistics
import time
from pathlib import Path

from kvmesh.benchmarks.peers import engines, setups
from kvmesh.benchmarks.peers.engines import EngineSpec
from kvmesh.benchmarks.peers.run import _ray_cpus
from kvmesh.cluster.stats import nearest_rank


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "p50_ms": 1000 * nearest_rank(xs, 0.5),
        "p90_ms": 1000 * nearest_rank(xs, 0.9),
        "p99_ms": 1000 * nearest_rank(xs, 0.99),
        "mean_ms": 1000 * statistics.fmean(xs),
    }


def _measure(
    url: str, n: int, headers: dict | None = None, seed: int = 0, prompt_tokens: int = 16, warmup: int = 10
) -> list[float]:
    import httpx

    rng = random.Random(seed)
    out = []
    with httpx.Client(timeout=60.0, headers=headers or {}) as client:
        for i in range(warmup + n):
            body = {
                "model": engines.SERVED_MODEL_NAME,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt": [rng.randrange(10, 600) for _ in range(prompt_tokens)],
            }
            t0 = time.perf_counter()
            r = client.post(url.rstrip("/") + "/v1/completions", json=body)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if i >= warmup:
                out.append(dt)
    return out


def _mean_ms(text: str, seconds_metric: str, count_metric: str) -> float | None:
    """Mean in ms of a Prometheus seconds total over its count (None when absent or zero)."""
    total = re.search(rf"^{seconds_metric}(?:\{{\}})?\s+(\S+)", text, re.M)
    count = re.search(rf"^{count_metric}(?:\{{\}})?\s+(\S+)", text, re.M)
    if not total or not count or float(count.group(1)) == 0:
        return None
    return 1000 * float(total.group(1)) / float(count.group(1))


def _kvmesh_ingress_ttft_ms(text: str) -> float | None:
    """Mean time from the ingress handler's start to the engine's first chunk (all requests seen)."""
    return _mean_ms(text, "kvmesh_ttft_seconds_sum", "kvmesh_ttft_seconds_count")


def _kvmesh_decision_ms(text: str) -> float | None:
    """Mean routing decision time (hash + index lookup + policy)."""
    return _mean_ms(text, "kvmesh_router_decision_seconds_total", "kvmesh_router_decisions_total")


def run_overhead(
    spec: EngineSpec,
    work_dir: Path,
    workers: int = 2,
    requests: int = 200,
    prompt_tokens: int = 16,
    log=lambda *a: print(*a, flush=True),
) -> dict:
    report: dict = {
        "engine": spec.as_dict(),
        "workers": workers,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "max_tokens": 1,
        "concurrency": 1,
    }
    servers = engines.start_servers(workers, spec, work_dir)
    try:
        report["direct"] = _quantiles(_measure(servers[0].url, requests, seed=1, prompt_tokens=prompt_tokens))
        log(f"direct      {report['direct']}")
        rr = setups.PeerSetup("vllm-router/round_robin", "vllm-router", "round_robin")
        proc, url, _ = setups.start_router(rr, servers, spec, work_dir / "logs")
        try:
            report["vllm-router/round_robin"] = _quantiles(_measure(url, requests, seed=2, prompt_tokens=prompt_tokens))
        finally:
            proc.stop()
        log(f"vllm-router {report['vllm-router/round_robin']}")
    finally:
        engines.stop_servers(servers)

    from kvmesh.deployments.app import start_local, stop_local

    # Ray's session folder in the work dir, for this app only: the caller's RAY_TMPDIR (or its absence) is
    # put back afterwards, so later Ray apps of the same process (make bench) do not land in a removed folder
    ray_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ.setdefault("RAY_TMPDIR", str(work_dir / "ray"))
    try:
        key = "kvm-bench-" + secrets.token_hex(6)
        url = start_local(
            {
                "replicas": workers,
                "policy": "kvmesh",
                "port": 0,
                "api_keys": [key],
                "engine": spec.kvmesh_engine_config(),
            },
            num_cpus=_ray_cpus(workers),
        )
        try:
            report["kvmesh"] = _quantiles(
                _measure(url, requests, headers={"Authorization": f"Bearer {key}"}, seed=3, prompt_tokens=prompt_tokens)
            )
            import httpx

            text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
            report["kvmesh"]["router_decision_ms_mean"] = _kvmesh_decision_ms(text)
            report["kvmesh"]["ingress_to_first_chunk_ms_mean"] = _kvmesh_ingress_ttft_ms(text)
        finally:
            stop_local()
    finally:
        if ray_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = ray_tmpdir
    log(f"kvmesh      {report['kvmesh']}")
    d = report["direct"]["p50_ms"]
    report["overhead_p50_ms"] = {
        "vllm-router/round_robin": report["vllm-router/round_robin"]["p50_ms"] - d,
        "kvmesh": report["kvmesh"]["p50_ms"] - d,
    }
    report["kvmesh_minus_vllm_router_p50_ms"] = report["kvmesh"]["p50_ms"] - report["vllm-router/round_robin"]["p50_ms"]
    log(
        f"overhead vs direct (p50): {report['overhead_p50_ms']}; kvmesh - vllm-router: "
        f"{report['kvmesh_minus_vllm_router_p50_ms']:.1f} ms"
    )
    return report

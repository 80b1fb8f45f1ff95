"""Per-request overhead of kvmesh's serving path (HTTP proxy -> ingress -> router -> engine replica)
against vllm-router round_robin in front of plain vLLM OpenAI servers, with the same engine settings.

Short prompts (16 fresh random tokens, so no prefix cache), max_tokens=1, one request at a time:
end-to-end latency is then mostly path overhead plus one tiny prefill. Three paths are measured:
`direct` (client -> vLLM server), `vllm-router` (client -> router -> vLLM server) and `kvmesh`
(client -> Serve proxy -> ingress -> kvmesh router -> engine). Overheads are differences of medians
against `direct`, and the median of each round's difference (`paired`). kvmesh's own routing decision time
comes from its /metrics (kvmesh_router_decision_seconds_total / kvmesh_router_decisions_total).

Why the paths are measured interleaved, one request each per round in a rotating order, with all of them
up: a shared machine's speed drifts over minutes (the bare server's own p50 moved from 4.3 to 7.8 ms
between runs of one afternoon here), so paths measured one after the other compare different machines,
and one drifting phase decided the verdict either way. Interleaved, every path sees the same drift and
the same background (the other setups' idle engines).
"""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kvmesh.benchmarks.peers import engines, setups
from kvmesh.benchmarks.peers.engines import EngineSpec
from kvmesh.benchmarks.peers.run import _ray_cpus, kvmesh_config, restore_env
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


def _body(rng: random.Random, prompt_tokens: int) -> dict:
    """One request: fresh random prompt tokens (nothing cached), one output token."""
    return {
        "model": engines.SERVED_MODEL_NAME,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt": [rng.randrange(10, 600) for _ in range(prompt_tokens)],
    }


def measure_interleaved(
    paths: dict[str, tuple[str, dict]],
    n: int,
    prompt_tokens: int = 16,
    warmup: int = 10,
    post: Callable[[str, str, dict], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per request on each path (name -> (base URL, headers)): `warmup` + `n` rounds of one request
    per path, the order rotated by one each round so that no path always follows the same one; warm-up
    rounds are not kept. `post(name, url, body)` sends one request and raises on a failed one (default:
    one keep-alive httpx client per path). Each path's prompts come from its own seeded generator."""
    names = list(paths)
    rngs = {name: random.Random(1 + i) for i, name in enumerate(names)}
    out: dict[str, list[float]] = {name: [] for name in names}
    clients: dict = {}
    if post is None:
        import httpx

        clients = {name: httpx.Client(timeout=60.0, headers=paths[name][1] or {}) for name in names}

        def post(name: str, url: str, body: dict) -> None:
            clients[name].post(url, json=body).raise_for_status()

    try:
        for i in range(warmup + n):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                body = _body(rngs[name], prompt_tokens)
                url = paths[name][0].rstrip("/") + "/v1/completions"
                t0 = time.perf_counter()
                post(name, url, body)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    out[name].append(dt)
    finally:
        for client in clients.values():
            client.close()
    return out


def paired_median_ms(a: list[float], b: list[float]) -> float:
    """Median over rounds of a's time less b's in the same round, in ms: what drift between rounds cannot
    move."""
    return 1000 * statistics.median(x - y for x, y in zip(a, b, strict=True))


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
    from kvmesh.deployments.app import start_local, stop_local

    rr = setups.PeerSetup("vllm-router/round_robin", "vllm-router", "round_robin")
    # Ray's session folder in the work dir, for this app only: the caller's RAY_TMPDIR (or its absence) is
    # put back afterwards, so later Ray apps of the same process (make bench) do not land in a removed folder
    ray_tmpdir = os.environ.get("RAY_TMPDIR")
    servers = engines.start_servers(workers, spec, work_dir)
    try:
        proc, router_url, _ = setups.start_router(rr, servers, spec, work_dir / "logs")
        try:
            os.environ.setdefault("RAY_TMPDIR", str(work_dir / "ray"))
            config, key = kvmesh_config(spec, workers)
            url = start_local(config, num_cpus=_ray_cpus(workers))
            try:
                times = measure_interleaved(
                    {
                        "direct": (servers[0].url, {}),
                        "vllm-router/round_robin": (router_url, {}),
                        "kvmesh": (url, {"Authorization": f"Bearer {key}"}),
                    },
                    requests,
                    prompt_tokens=prompt_tokens,
                )
                import httpx

                text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
            finally:
                stop_local()
        finally:
            proc.stop()
            restore_env("RAY_TMPDIR", ray_tmpdir)
    finally:
        engines.stop_servers(servers)
    for name, xs in times.items():
        report[name] = _quantiles(xs)
    report["kvmesh"]["router_decision_ms_mean"] = _kvmesh_decision_ms(text)
    report["kvmesh"]["ingress_to_first_chunk_ms_mean"] = _kvmesh_ingress_ttft_ms(text)
    report["measured"] = "interleaved: one request per path per round, the order rotated each round"
    for name in times:
        log(f"{name:<24} {report[name]}")
    d = report["direct"]["p50_ms"]
    report["overhead_p50_ms"] = {
        "vllm-router/round_robin": report["vllm-router/round_robin"]["p50_ms"] - d,
        "kvmesh": report["kvmesh"]["p50_ms"] - d,
    }
    report["kvmesh_minus_vllm_router_p50_ms"] = report["kvmesh"]["p50_ms"] - report["vllm-router/round_robin"]["p50_ms"]
    report["overhead_paired_ms"] = {
        name: paired_median_ms(times[name], times["direct"]) for name in ("vllm-router/round_robin", "kvmesh")
    }
    log(
        f"overhead vs direct (p50): {report['overhead_p50_ms']}; kvmesh - vllm-router: "
        f"{report['kvmesh_minus_vllm_router_p50_ms']:.1f} ms; paired per round: {report['overhead_paired_ms']}"
    )
    return report

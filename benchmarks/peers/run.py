"""One side-by-side run: per workload and prompt form, every peer setup on N identical vLLM OpenAI
servers, then kvmesh (`kvmesh.deployments.app.start_local`) with the same engine settings; the same replay
client and settings for all (kvmesh.deployments.replay). kvmesh's run of a workload and form follows its
peers' at once (the servers stopped to free the cores, started again for the next peers): a machine whose
speed drifts over minutes then moves both alike. Run after every peer of every workload, kvmesh's TTFT on a
workload was measured minutes after its peers', and the ratio of the two moved by up to 2x between runs
of one afternoon. Caches start cold for every setup:
- `restart` (default): fresh server processes per setup (there is no prefix-cache reset endpoint);
- `reseed`: the same processes, but every setup's prompts are drawn with another seed, so no block of
  one setup can hit a block of another (same block structure, disjoint tokens; KV space is ample:
  2.1M tokens per engine, a whole 4-worker run puts < 0.5M on each).
kvmesh gets a fresh app (engines, router, policy state) for every workload and form in both modes, as
each peer gets a fresh router process.
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.benchmarks.peers import engines, metrics, results, setups
from kvmesh.benchmarks.peers.engines import EngineSpec
from kvmesh.benchmarks.peers.setups import KVMESH, PEER_SETUPS

WORKLOADS = ("chat", "mooncake", "flood")
FORMS = ("tokens", "text")


@dataclass
class BenchConfig:
    spec: EngineSpec
    work_dir: Path
    workers: int = 4
    workloads: tuple = WORKLOADS
    forms: tuple = FORMS
    setups: tuple = tuple(setups.SETUP_NAMES)
    limit: int | None = None
    concurrency: int = 4
    max_tokens: int = 8
    tokens_per_block: int = 32
    cold: str = "restart"
    progress: bool = True
    log: Callable[..., None] = field(default=lambda *a: print(*a, flush=True))


def build_workloads(cfg: BenchConfig) -> dict[str, list[dict]]:
    """The three workloads (chat, mooncake, flood), scaled so every prompt fits the engines' context."""
    from kvmesh.cluster.trace import read_records
    from kvmesh.cluster.workloads import ChatSpec, conversation_slice, synth_chat, synth_flood

    out: dict[str, list[dict]] = {}
    max_prompt = cfg.spec.max_model_len - cfg.max_tokens - 8
    for name in cfg.workloads:
        if name == "chat":
            recs = synth_chat(ChatSpec(tenants=2, groups=2, users=4, turns=4, seed=0))
        elif name == "mooncake":
            recs = conversation_slice(
                read_records("conversation"),
                conversations=48,
                min_turns=3,
                tokens_per_block=cfg.tokens_per_block,
                max_prompt_tokens=max_prompt,
            )
        elif name == "flood":
            recs = synth_flood(requests=384, system_blocks=8, unique_blocks=2, interval_ms=50.0)
        else:
            raise ValueError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
        out[name] = recs[: cfg.limit] if cfg.limit else recs
    return out


def _replay(
    records,
    cfg: BenchConfig,
    url: str,
    form: str,
    seed: int,
    label: str,
    api_key: str | None = None,
    model: str | None = None,
):
    from kvmesh.deployments.replay import ReplayConfig, replay

    rc = ReplayConfig(
        url=url,
        model=model,
        tokens_per_block=cfg.tokens_per_block,
        concurrency=cfg.concurrency,
        api_key=api_key,
        prompt_form=form,
        max_tokens=cfg.max_tokens,
        tokenizer=cfg.spec.model,
        timeout_s=300.0,
        label=label,
        seed=seed,
        progress=cfg.progress,
    )
    return replay(records, rc).summary()


class _Servers:
    """The N vLLM servers, cold for every setup (restart or reseed)."""

    def __init__(self, cfg: BenchConfig):
        self.cfg, self.runs = cfg, 0
        self.servers: list[engines.VllmServer] = []

    def cold(self) -> tuple[list, int]:
        self.runs += 1
        if self.cfg.cold == "restart" or not self.servers:
            t0 = time.perf_counter()
            engines.stop_servers(self.servers)
            # a peer that subscribes to the engines' KV events itself takes only a TCP source
            tcp = any(s.policy == "kv_aware" for s in PEER_SETUPS if s.name in self.cfg.setups)
            self.servers = engines.start_servers(self.cfg.workers, self.cfg.spec, self.cfg.work_dir, kv_events_tcp=tcp)
            self.cfg.log(f"  {self.cfg.workers} vLLM servers cold-started in {time.perf_counter() - t0:.0f}s")
        return self.servers, (0 if self.cfg.cold == "restart" else self.runs)

    def stop(self) -> None:
        engines.stop_servers(self.servers)
        self.servers = []


def replay_through_peer(
    setup, servers, spec: EngineSpec, log_dir: Path, send: Callable[[str], dict]
) -> tuple[dict, list[dict]]:
    """Start the peer router over `servers`, run `send(router_url)` (a replay, returning its summary),
    stop the router; return the summary and per-worker figures from the servers' /metrics deltas (a
    peer names no replica in its responses)."""
    proc, url, _ = setups.start_router(setup, servers, spec, log_dir)
    try:
        before = [metrics.scrape(s.url) for s in servers]
        summary = send(url)
        time.sleep(0.5)  # let the servers' counters settle after the last stream closed
        after = [metrics.scrape(s.url) for s in servers]
    finally:
        proc.stop()
    return summary, results.workers_from_metric_deltas([metrics.delta(b, a) for b, a in zip(before, after)])


def run_peer(setup, records, cfg: BenchConfig, servers, seed: int, workload: str, form: str, bound) -> dict:
    summary, workers = replay_through_peer(
        setup,
        servers,
        cfg.spec,
        cfg.work_dir / "logs",
        # sglang-router's /v1/models answers "unknown": name the servers' model explicitly
        lambda url: _replay(records, cfg, url, form, seed, label=setup.name, model=engines.SERVED_MODEL_NAME),
    )
    return results.make_row(workload, form, setup.name, summary, workers, bound)


def _prediction(url: str, key: str) -> dict:
    """kvmesh's predicted-vs-delivered ledger (GET /kvmesh/state): did the router know what the
    engines would serve from cache? Empty if the endpoint is unavailable."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/kvmesh/state", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        return r.json().get("prediction") or {}
    except (httpx.HTTPError, ValueError):
        return {}


def _prediction_delta(url: str, key: str, before: dict) -> dict:
    after = _prediction(url, key)
    keys = ("compared", "mismatches", "predicted_tokens", "delivered_tokens", "alarms")
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if k in after}


def _ray_cpus(workers: int) -> int:
    """Logical CPUs for the local Ray: every engine replica asks Serve for 0.5 CPU (deployments/config.py)
    and the ingress for 0.1, so 4 replicas on a 2-core machine need more logical CPUs than cores (the
    engines share the cores anyway, exactly like the N vLLM servers of the peer runs)."""
    return max(os.cpu_count() or 2, math.ceil(0.5 * workers + 0.1 + 1))


def kvmesh_config(spec: EngineSpec, workers: int) -> tuple[dict, str]:
    """The app config of a peer bench's kvmesh run (this bench's and the overhead bench's): `workers` engine
    replicas with the peers' engine settings, on a free port, and its fresh API key."""
    key = "kvm-bench-" + secrets.token_hex(6)
    config = {
        "replicas": workers,
        "policy": "kvmesh",
        "port": 0,
        "api_keys": [key],
        "engine": spec.kvmesh_engine_config(),
    }
    return config, key


def run_kvmesh(workload: str, form: str, records: list[dict], cfg: BenchConfig, bound: float) -> dict:
    """kvmesh on one workload and form: a fresh app (engines, router, policy state), like each peer's fresh
    router process, so nothing learned on one workload carries over to the next."""
    from kvmesh.deployments.app import start_local, stop_local

    # Ray's session folder in the work dir, for this app only: the caller's RAY_TMPDIR (or its absence) is put
    # back afterwards, so later Ray apps of the same process (make bench) do not land in a removed folder
    ray_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ.setdefault("RAY_TMPDIR", str(cfg.work_dir / "ray"))
    try:
        config, key = kvmesh_config(cfg.spec, cfg.workers)
        t0 = time.perf_counter()
        url = start_local(config, num_cpus=_ray_cpus(cfg.workers))
        try:
            before = _prediction(url, key)
            cfg.log(f"  kvmesh with {cfg.workers} replicas started in {time.perf_counter() - t0:.0f}s")
            cfg.log(f"[{workload}/{form}] {KVMESH}")
            summary = _replay(records, cfg, url, form, 0, label=KVMESH, api_key=key)
            workers = results.workers_from_replay(summary["per_replica"], cfg.workers)
            row = results.make_row(workload, form, KVMESH, summary, workers, bound)
            row["prediction"] = _prediction_delta(url, key, before)
            return row
        finally:
            stop_local()
    finally:
        restore_env("RAY_TMPDIR", ray_tmpdir)


def restore_env(name: str, value: str | None) -> None:
    """Put an environment variable back as it was (`value` None: it was unset)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _checkpoint(cfg: BenchConfig, rows: list[dict]) -> None:
    """Rows so far, so a run cut short (time limit, crash) still leaves its measurements."""
    import json

    (cfg.work_dir / "rows.partial.json").write_text(json.dumps(rows, indent=1))


def run(cfg: BenchConfig) -> tuple[list[dict], dict]:
    from kvmesh.cluster.bounds import record_bounds

    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    workloads = build_workloads(cfg)
    bounds = {
        name: record_bounds(recs, cfg.tokens_per_block, cfg.spec.block_size, replicas=cfg.workers)
        for name, recs in workloads.items()
    }
    bound_rates = {name: b["infinite"]["hit_rate"] for name, b in bounds.items()}
    peers = [s for s in PEER_SETUPS if s.name in cfg.setups]
    rows: list[dict] = []
    pool = _Servers(cfg)
    try:
        for workload, records in workloads.items():
            for form in cfg.forms:
                for setup in peers:
                    servers, seed = pool.cold()
                    cfg.log(f"[{workload}/{form}] {setup.name} ({len(records)} requests)")
                    rows.append(run_peer(setup, records, cfg, servers, seed, workload, form, bound_rates[workload]))
                    _checkpoint(cfg, rows)
                if KVMESH in cfg.setups:
                    pool.stop()  # free the cores and memory before kvmesh starts its own engines
                    rows.append(run_kvmesh(workload, form, records, cfg, bound_rates[workload]))
                    _checkpoint(cfg, rows)
    finally:
        pool.stop()
    order = {name: i for i, name in enumerate(setups.SETUP_NAMES)}
    rows.sort(
        key=lambda r: (
            list(workloads).index(r["workload"]),
            list(cfg.forms).index(r["form"]),
            order.get(r["setup"], 99),
        )
    )
    extra = {"bounds": bounds, "workload_sizes": {k: len(v) for k, v in workloads.items()}}
    return rows, extra

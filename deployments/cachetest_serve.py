"""`kvmesh cachetest --serve`: start kvmesh (tiny model, one API key per tenant of the log) for the test,
run the passes against it, and stop it; with a replica sweep, a fresh app per replica count runs a cold
and a warm pass (`replicas_N_cold`, `replicas_N`), so every count starts from an empty cache. The main
app's own count (`--replicas`) is not run again: its `warm` pass, sent the same way (after a cold pass on
a reset cache, at the first concurrency), is the sweep's point there; only when `--passes` lacks `cold`
or `warm` does that count get a `replicas_N` app of its own.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvmesh.cluster.cachetest_analysis import Prepared
from kvmesh.deployments.cachetest import CachetestConfig, CachetestError, Runner, offline_figures

OPERATOR = "cachetest-operator"  # the test's own tenant: reads the server's counters and every record whole


def tenants_file(folder: Path, tenants: Sequence[str]) -> tuple[Path, dict[str, str], str]:
    """A tenants file with one fresh key per tenant (no limits) and one for the test itself, an operator;
    (path, tenant -> key, the operator's key)."""
    import yaml

    from kvmesh.deployments.tenants import hash_api_key, new_api_key

    keys = {t: new_api_key() for t in tenants}
    operator_key = new_api_key()
    entries: list[dict] = [{"id": t, "keys": [{"sha256": hash_api_key(k)}]} for t, k in keys.items()]
    entries.append({"id": OPERATOR, "keys": [{"sha256": hash_api_key(operator_key)}], "operator": True})
    doc = {"tenants": entries}
    path = folder / "tenants.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, keys, operator_key


def app_config_for(tenants_path: Path, replicas: int, block_size: int, gpu_blocks: int = 1024) -> dict:
    from kvmesh.cluster.ports import free_port

    return {
        "replicas": replicas,
        "policy": "kvmesh",
        "port": free_port(),
        "tenants_file": str(tenants_path),
        "routing_stats_period_s": 0.5,
        "allow_cache_reset": True,  # the cold pass resets the engines' caches (POST /kvmesh/reset_prefix_cache)
        "engine": {
            "model": "tiny",
            "block_size": block_size,
            "max_model_len": 2048,
            "num_gpu_blocks_override": gpu_blocks,
        },
    }


def serve_and_test(
    cfg: CachetestConfig,
    prepared: Sequence[Prepared],
    tokenizer,
    replicas: int,
    sweep: Sequence[int] | None,
    progress: bool,
) -> dict:
    from kvmesh.deployments.app import start_local, stop_local

    tenants = sorted({p.req.tenant or "default" for p in prepared})
    for p in prepared:  # untenanted requests go to tenant "default"
        if p.req.tenant is None:
            p.req.tenant = "default"
            p.tok.tenant = "default"
    folder = Path(tempfile.mkdtemp(prefix="kvmesh-cachetest-"))
    try:  # the tenants file (key digests) goes with the test
        path, keys, operator_key = tenants_file(folder, tenants)
        cfg = replace(cfg, tenant_keys=keys, api_key=operator_key)  # every request has its tenant's key
        offline = offline_figures(prepared, cfg.block_size, cfg.bound_replicas)
        main_runner: Runner | None = None
        # the main app's warm pass (after its cold pass) is the sweep's point at its own count: every pass
        # records its app's replicas (`cachetest_html.sweeps`)
        main_is_point = "cold" in cfg.passes and "warm" in cfg.passes
        counts = [replicas, *[n for n in dict.fromkeys(sweep or []) if n != replicas or not main_is_point]]
        for k, n in enumerate(counts):
            try:
                url = start_local(app_config_for(path, n, cfg.block_size), timeout_s=600)
            except Exception as exc:
                stop_local()
                raise CachetestError(f"--serve: could not start kvmesh with {n} replicas: {exc}") from None
            try:
                run_cfg = replace(cfg, url=url)
                runner = Runner(run_cfg, prepared, tokenizer, progress=progress)
                if k == 0:
                    runner.run_all()
                    for run in runner.runs:
                        run.replicas = n
                    main_runner = runner
                else:
                    assert main_runner is not None
                    runner.clock = main_runner.clock
                    runner.runs = main_runner.runs  # one history: later apps are fresh, their passes append
                    cold = runner.send(f"replicas_{n}_cold", prepared, cfg.concurrency[0])
                    cold.fresh_fleet = True
                    warm = runner.send(f"replicas_{n}", prepared, cfg.concurrency[0])
                    cold.replicas = warm.replicas = n
                    main_runner.clock = runner.clock
            finally:
                stop_local()
        assert main_runner is not None
        report = main_runner.report(offline, meta={"served_by_cachetest": True, "replicas": counts})
        report["meta"]["url"] = "kvmesh started by cachetest --serve"
        return report
    finally:
        shutil.rmtree(folder, ignore_errors=True)

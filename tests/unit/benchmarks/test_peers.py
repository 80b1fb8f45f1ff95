"""The peer benchmark's pure parts: /metrics parsing and deltas, per-worker aggregation, the live
targets of `results.check_targets` (including the cases that must fail), the table, the JSON/PNG writers, and the CLI's
one-line errors. The live run itself needs the peers installed and minutes of CPU: `kvmesh bench peers`."""

from __future__ import annotations

import json
import os

import pytest

from kvmesh.benchmarks.peers import metrics, results
from kvmesh.deployments import cli

METRICS_BEFORE = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 32.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 100.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 2.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7e+09
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace("} 100.0\nvllm:prefix_cache_hits", "} 740.0\nvllm:prefix_cache_hits")
    .replace("} 32.0", "} 416.0")
    .replace('"length",model_name="tiny"} 2.0', '"length",model_name="tiny"} 5.0')
)


def test_metrics_parse_sums_label_sets_and_ignores_other_metrics():
    m = metrics.parse(METRICS_BEFORE)
    assert m == {"prompt_tokens": 100.0, "prefix_hits": 32.0, "prefix_queries": 100.0, "requests": 3.0}


def test_metrics_delta():
    d = metrics.delta(metrics.parse(METRICS_BEFORE), metrics.parse(METRICS_AFTER))
    assert d == {"prompt_tokens": 640, "prefix_hits": 384, "prefix_queries": 0, "requests": 3}
    w = results.workers_from_metric_deltas([d])
    assert w == [{"requests": 3, "prompt_tokens": 640, "cached_tokens": 384, "prefill_tokens": 256}]


def test_max_over_mean_counts_idle_workers():
    assert results.max_over_mean([10, 10, 10, 10]) == 1.0
    assert results.max_over_mean([0, 60, 30, 0]) == pytest.approx(60 / 22.5)  # a cache_aware pile-up: two workers idle
    assert results.max_over_mean([0, 0]) is None and results.max_over_mean([]) is None


def _summary(hit, errors=0, requests=10, uncached=100, p50=0.05):
    return {
        "requests": requests,
        "errors": errors,
        "hit_rate_tokens": hit,
        "uncached_prompt_tokens": uncached,
        "ttft_p50_s": p50,
        "ttft_p90_s": 0.1,
        "per_replica": {},
    }


def _workers(prefill):
    return [{"requests": 1, "prompt_tokens": p, "cached_tokens": 0, "prefill_tokens": p} for p in prefill]


def _rows(kvmesh_hit, kvmesh_prefill, peer_hit=0.79, kvmesh_errors=0, bound=0.82):
    return [
        results.make_row(
            "chat", "tokens", "vllm-router/cache_aware", _summary(peer_hit), _workers([0, 60, 30, 0]), bound
        ),
        results.make_row(
            "chat", "tokens", "sglang-router/cache_aware", _summary(None, errors=10), _workers([0] * 4), bound
        ),
        results.make_row(
            "chat", "tokens", "kvmesh", _summary(kvmesh_hit, errors=kvmesh_errors), _workers(kvmesh_prefill), bound
        ),
    ]


def test_targets_pass_when_kvmesh_is_ahead_balanced_and_clean():
    [v] = results.check_targets(_rows(0.80, [25, 22, 21, 22]))
    assert v["pass"] and v["best_peer"] == "vllm-router/cache_aware"  # the all-error peer is not 'best'
    assert all(v["checks"].values())


@pytest.mark.parametrize(
    "kw, failing",
    [
        (dict(kvmesh_hit=0.77, kvmesh_prefill=[25, 22, 21, 22], bound=0.80), "hit >= best peer - 0.01"),
        (dict(kvmesh_hit=0.80, kvmesh_prefill=[25, 22, 21, 22], peer_hit=0.70, bound=0.90), "hit >= 0.95 x bound"),
        (dict(kvmesh_hit=0.80, kvmesh_prefill=[0, 60, 30, 0]), "prefill max/mean <= 1.25"),
        (dict(kvmesh_hit=0.80, kvmesh_prefill=[25, 22, 21, 22], kvmesh_errors=1), "zero errors"),
    ],
)
def test_targets_miss(kw, failing):
    [v] = results.check_targets(_rows(**kw))
    assert not v["pass"]
    assert v["checks"][failing] is False
    assert [k for k, ok in v["checks"].items() if ok is False] == [failing]


def _ttft_rows(kvmesh_p50: float, peers: list[tuple[str, float, float]], kvmesh_hit: float = 0.80) -> list[dict]:
    """kvmesh (balanced, clean, at `kvmesh_hit`) and `peers` as (setup, hit rate, TTFT p50 s)."""
    rows = [
        results.make_row("chat", "tokens", setup, _summary(hit, p50=p50), _workers([25, 22, 21, 22]), 0.82)
        for setup, hit, p50 in peers
    ]
    rows.append(
        results.make_row(
            "chat", "tokens", "kvmesh", _summary(kvmesh_hit, p50=kvmesh_p50), _workers([25, 22, 21, 22]), 0.82
        )
    )
    return rows


@pytest.mark.parametrize("kvmesh_p50, met", [(0.022, True), (0.026, False), (0.024, True), (0.0241, False)])
def test_ttft_target_is_judged_against_the_best_peer_at_equal_hit_rate(kvmesh_p50, met):
    """docs/peers.md states kvmesh's TTFT p50 within 1.2x of the best peer at equal hit rate, and the live
    bench did not judge it: a row at 1.3x passed."""
    [v] = results.check_targets(_ttft_rows(kvmesh_p50, [("vllm-router/cache_aware", 0.80, 0.020)]))
    check = "TTFT p50 <= 1.2 x best peer at equal hit"
    assert v["pass"] is met  # 1.1x / 1.2x pass; 1.3x / just over 1.2x miss
    assert v["checks"][check] is met
    assert [k for k, ok in v["checks"].items() if ok is not True] == ([] if met else [check])
    assert v["ttft_peer"] == "vllm-router/cache_aware" and v["ttft_ratio"] == pytest.approx(kvmesh_p50 / 0.020)
    line = results.format_verdicts([v])
    assert line.startswith("PASS" if met else "MISS")
    assert f"TTFT p50 kvmesh {round(kvmesh_p50 * 1000)} ms vs vllm-router/cache_aware 20 ms" in line
    assert f"= {kvmesh_p50 / 0.020:.2f}x" in line and f"{check}: {'PASS' if met else 'MISS'}" in line


def test_ttft_best_peer_is_the_fastest_among_peers_at_kvmeshs_hit_rate_only():
    """A faster peer 0.05 below kvmesh's hit rate is not at equal hit rate; one 0.005 below, or above, is."""
    peers = [
        ("vllm-router/round_robin", 0.75, 0.010),  # fastest, but well below kvmesh's hit rate: not compared
        ("vllm-router/kv_aware", 0.795, 0.030),  # within 0.01: at kvmesh's hit rate
        ("vllm-router/cache_aware", 0.81, 0.025),  # above: at (or past) kvmesh's hit rate, the fastest such
        ("sglang-router/cache_aware", None, None),  # failed every request: no figures
    ]
    [v] = results.check_targets(_ttft_rows(0.0275, peers))
    assert v["ttft_peer"] == "vllm-router/cache_aware" and v["ttft_peer_p50_s"] == 0.025
    assert v["ttft_ratio"] == pytest.approx(1.1) and v["checks"]["TTFT p50 <= 1.2 x best peer at equal hit"] is True
    [slow] = results.check_targets(_ttft_rows(0.0325, peers))  # 1.3x the peer at equal hit rate
    assert slow["ttft_peer"] == "vllm-router/cache_aware" and not slow["pass"]
    # no peer at kvmesh's hit rate: nothing to compare at equal hit rate, the target is not missed
    [ahead] = results.check_targets(_ttft_rows(0.05, [("vllm-router/round_robin", 0.75, 0.010)]))
    assert ahead["ttft_peer"] is None and ahead["checks"]["TTFT p50 <= 1.2 x best peer at equal hit"] is True
    assert "no peer at its hit rate" in results.format_verdicts([ahead])


def test_table_json_png(tmp_path):
    rows = _rows(0.80, [25, 22, 21, 22])
    table = results.format_table(rows)
    assert "vllm-router/cache_aware" in table and "0/60/30/0" in table and "80.0%" in table
    assert "2.67" in table  # peer's prefill max/mean
    verdicts = results.check_targets(rows)
    assert results.format_verdicts(verdicts).startswith("PASS  chat/tokens")
    results.write_json(tmp_path / "p.json", {"workers": 4}, rows, verdicts)
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["rows"][2]["setup"] == "kvmesh" and data["targets"][0]["pass"] is True
    results.write_png(tmp_path / "p.png", rows)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workers_from_replay_pads_idle_replicas():
    per_replica = {"r1": {"requests": 3, "prompt_tokens": 300, "cached_tokens": 100}}
    w = results.workers_from_replay(per_replica, 2)
    assert [x["prefill_tokens"] for x in w] == [200, 0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "peers", "--workloads", "nope"], "choose from chat, mooncake, flood"),
        (["bench", "peers", "--workers", "0"], "--workers: must be >= 1"),
        (["bench", "peers", "--setups", "vllm-router/magic"], "choose from"),
        (["bench", "peers", "--block-size", "48", "--model", "/nonexistent"], "multiple of 32"),
        (["bench", "peers", "--model", "/nonexistent"], "no config.json"),
        (["bench"], "required"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path):
    assert cli.main(argv + (["--work-dir", str(tmp_path)] if len(argv) > 2 else [])) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_merge_rows_later_run_replaces_same_setup():
    first = _rows(0.80, [25, 22, 21, 22])
    fixed = [results.make_row("chat", "tokens", "sglang-router/cache_aware", _summary(0.85), _workers([40, 4]), 0.82)]
    merged = results.merge_rows(first, fixed)
    assert len(merged) == 3
    sg = [r for r in merged if r["setup"] == "sglang-router/cache_aware"][0]
    assert sg["hit_rate_tokens"] == 0.85 and sg["errors"] == 0
    [v] = results.check_targets(merged)
    assert v["best_peer"] == "sglang-router/cache_aware" and v["checks"]["hit >= best peer - 0.01"] is False


def test_overhead_reads_kvmesh_metrics():
    from kvmesh.benchmarks.peers.overhead import _kvmesh_decision_ms, _kvmesh_ingress_ttft_ms, _quantiles

    text = (
        "kvmesh_ttft_seconds_sum{} 1.5\nkvmesh_ttft_seconds_count{} 100\n"
        'kvmesh_ttft_seconds_sum{replica="a"} 9\nkvmesh_router_decisions_total 10\n'
        "kvmesh_router_decision_seconds_total 0.005\n"
    )
    assert _kvmesh_ingress_ttft_ms(text) == pytest.approx(15.0)
    assert _kvmesh_decision_ms(text) == pytest.approx(0.5)
    assert _kvmesh_decision_ms("kvmesh_router_decisions_total 0\n") is None
    q = _quantiles([0.001 * i for i in range(1, 101)])
    assert q["n"] == 100 and q["p50_ms"] == pytest.approx(50.0) and q["p99_ms"] == pytest.approx(99.0)


def test_the_overhead_paths_are_measured_interleaved_in_a_rotating_order():
    """Measured one path after another, a machine whose speed drifts between phases decided the overhead
    either way; each round now sends one request per path, the order rotated each round, and each path's
    time is its own request's. The clock here moves only when a request is sent: 1 ms a request, plus a
    drift of 1 ms per round and a fixed 3 ms on the slow path."""
    from kvmesh.benchmarks.peers import overhead

    clock = {"t": 0.0}
    sent: list[str] = []
    cost = {"a": 0.001, "b": 0.001, "slow": 0.004}

    def post(name, url, body):
        assert url == f"http://{name}/v1/completions" and len(body["prompt"]) == 16 and body["max_tokens"] == 1
        sent.append(name)
        clock["t"] += cost[name] + 0.001 * ((len(sent) - 1) // 3)  # the drift: each round 1 ms slower

    real = overhead.time.perf_counter
    overhead.time.perf_counter = lambda: clock["t"]
    try:
        times = overhead.measure_interleaved(
            {p: (f"http://{p}", {}) for p in ("a", "b", "slow")}, 6, warmup=2, post=post
        )
    finally:
        overhead.time.perf_counter = real
    rounds = [sent[i : i + 3] for i in range(0, len(sent), 3)]
    assert len(rounds) == 8 and all(sorted(r) == ["a", "b", "slow"] for r in rounds)
    assert [r[0] for r in rounds[:3]] == ["a", "b", "slow"]  # rotated: no path always goes first
    assert {p: len(xs) for p, xs in times.items()} == {"a": 6, "b": 6, "slow": 6}  # warm-up rounds dropped
    # within a round the drift is the same for every path, so the paired difference is exactly the path's own
    assert overhead.paired_median_ms(times["slow"], times["a"]) == pytest.approx(3.0)
    assert overhead.paired_median_ms(times["b"], times["a"]) == pytest.approx(0.0)


def test_cli_missing_peer_is_one_line(monkeypatch, capsys, tmp_path):
    from kvmesh.benchmarks.peers import setups

    def missing(name):
        raise FileNotFoundError(name)

    monkeypatch.setattr(setups, "router_binary", missing)
    assert cli.main(["bench", "peers", "--setups", "sglang-router/cache_aware", "--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "sglang-router is not installed" in err and "\n" not in err


@pytest.mark.parametrize("workers", [1, 2, 4, 8, 16])
def test_local_ray_has_room_for_every_replica(workers):
    """4 replicas x 0.5 CPU + ingress 0.1 must fit the local Ray even on a 2-core machine."""
    from kvmesh.benchmarks.peers.run import _ray_cpus
    from kvmesh.deployments.config import ENGINE_DEFAULTS

    assert _ray_cpus(workers) >= ENGINE_DEFAULTS["num_cpus"] * workers + 0.1


# ------------------------------------------- the bench's workloads through the simulator (seconds)
def _turn_order(records, jitter_seed=None):
    """The order the replay client sends in at a fixed concurrency: users' turns in order, first turns
    first (a turn waits for the previous reply); `jitter_seed` perturbs the interleaving."""
    import random

    rng = random.Random(jitter_seed)
    turn, keyed = {}, []
    for i, r in enumerate(records):
        t = turn.get(r["user"], 0)
        turn[r["user"]] = t + 1
        keyed.append((t + (rng.random() * 1.5 if jitter_seed is not None else 0.0), i, r))
    return [r for _, _, r in sorted(keyed, key=lambda x: (x[0], x[1]))]


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("workload", ["chat", "mooncake", "flood"])
def test_kvmesh_meets_the_peer_bench_targets_on_its_workloads_in_the_simulator(workload, workers, tmp_path):
    """The live targets (>= 0.95 x bound, within 0.01 of sglang's cache-aware policy, prefill tokens per
    worker max/mean <= 1.25) on the exact workloads `kvmesh bench peers` replays, in several send orders.
    A policy change that breaks them fails here in seconds, before a 10-minute live run (kvmesh with
    the hard guard and no hot-prefix weight, `guard_weight=None, hot_recompute_weight=30`, fails on
    mooncake at 4 workers)."""
    from kvmesh.benchmarks.peers.engines import EngineSpec
    from kvmesh.benchmarks.peers.run import BenchConfig, build_workloads
    from kvmesh.cluster.bounds import record_bounds
    from kvmesh.cluster.simulator import SimConfig, simulate_policy
    from kvmesh.cluster.workloads import engine_trace
    from kvmesh.policies.registry import make_policy

    recs = build_workloads(
        BenchConfig(spec=EngineSpec(model="x"), work_dir=tmp_path, workers=workers, workloads=(workload,))
    )[workload]
    bound = record_bounds(recs, 32, 32)["infinite"]["hit_rate"]
    for order in (recs, _turn_order(recs), _turn_order(recs, 1), _turn_order(recs, 2)):
        trace = engine_trace(order, 32)
        arrivals = [0.5 * i for i in range(len(order))]  # one at a time, caches updated in between
        cfg = SimConfig(workers, 10**6)
        k = simulate_policy(trace, cfg, make_policy("kvmesh"), arrivals=arrivals)
        peer = simulate_policy(trace, cfg, make_policy("sglang_cache_aware"), arrivals=arrivals)
        hit = k["hit_rate_tokens"]
        assert hit >= 0.95 * bound and hit >= peer["hit_rate_tokens"] - 0.01, (hit, peer["hit_rate_tokens"], bound)
        assert k["imbalance"] <= 1.25, k["imbalance"]


def test_engine_trace_gives_one_id_per_engine_block_and_keeps_tenants_apart():
    from kvmesh.cluster.workloads import engine_trace

    recs = [
        {"timestamp": 0, "input_length": 600, "output_length": 512, "hash_ids": [1, 2], "tenant": "a"},
        {"timestamp": 1, "input_length": 600, "output_length": 512, "hash_ids": [1, 3], "tenant": "a"},
        {"timestamp": 2, "input_length": 600, "output_length": 512, "hash_ids": [1, 2], "tenant": "b"},
    ]
    t = engine_trace(recs, 64, 32)
    a, a2, b = (r.hash_ids for r in t.requests)
    assert t.block_size == 32 and [r.input_length for r in t.requests] == [64 + 11] * 3  # 88 of 512 -> 11 of 64
    assert len(a) == 3 and a[:2] == a2[:2] and a[2] != a2[2]  # 2 full engine blocks of id 1, then a partial
    assert not set(a) & set(b)  # another tenant shares nothing


@pytest.mark.parametrize("tcp", [False, True])
def test_peer_servers_publish_kv_events_privately_unless_a_peer_subscribes_over_tcp(tcp, monkeypatch, tmp_path):
    """By default each bare vLLM server's KV events (token ids included) go to a unix socket in a 0700
    folder, removed with the server; only a run with a TCP-subscribing peer binds them on TCP. vLLM's own
    IPC sockets and its torch.distributed file store go to the same folder either way (`VLLM_RPC_BASE_PATH`,
    `TMPDIR`), so none is left in /tmp."""
    import json
    import os
    import stat

    from kvmesh.benchmarks.peers import engines, procs

    started = []

    class FakeProc:
        def __init__(self, cmd, env):
            self.cmd, self.env = cmd, env

    monkeypatch.setattr(
        procs, "start", lambda name, cmd, log_dir, env: started.append(FakeProc(cmd, env)) or started[-1]
    )
    monkeypatch.setattr(procs, "wait_ready", lambda *a, **k: None)
    monkeypatch.setattr(procs, "stop_all", lambda ps: None)
    servers = engines.start_servers(2, engines.EngineSpec(model="m"), tmp_path, kv_events_tcp=tcp)
    binds = [json.loads(p.cmd[p.cmd.index("--kv-events-config") + 1])["endpoint"] for p in started]
    assert len(set(binds)) == 2
    for s, bind, p in zip(servers, binds, started):
        assert s.private_dir and stat.S_IMODE(os.stat(s.private_dir).st_mode) == 0o700
        assert p.env["VLLM_RPC_BASE_PATH"] == p.env["TMPDIR"] == s.private_dir
        if tcp:
            port = bind.removeprefix("tcp://[::ffff:127.0.0.1]:")
            assert port.isdigit() and s.kv_endpoint == f"tcp://127.0.0.1:{port}"
        else:
            assert bind == s.kv_endpoint == f"ipc://{s.private_dir}/kv"
    assert len({s.private_dir for s in servers}) == 2
    engines.stop_servers(servers)
    assert not any(os.path.exists(s.private_dir or "") for s in servers)


def test_peer_servers_failing_to_start_leave_no_process_or_folder(monkeypatch, tmp_path):
    """When the second server cannot be started, the first is stopped and neither private folder is left."""
    import glob

    from kvmesh.benchmarks.peers import engines, procs

    started, stopped = [], []

    def start(name, cmd, log_dir, env):
        if started:
            raise OSError("cannot start")
        started.append(name)
        return name

    before = set(glob.glob("/tmp/kvmesh-peer-*"))
    monkeypatch.setattr(procs, "start", start)
    monkeypatch.setattr(procs, "wait_ready", lambda *a, **k: None)
    monkeypatch.setattr(procs, "stop_all", stopped.extend)
    with pytest.raises(OSError, match="cannot start"):
        engines.start_servers(2, engines.EngineSpec(model="m"), tmp_path)
    assert stopped == ["vllm-0"]
    assert set(glob.glob("/tmp/kvmesh-peer-*")) == before


def _failing_peer_rows(errors, hit, form="tokens", setup="vllm-router/cache_aware"):
    """kvmesh ahead of the peers that answered; `setup` (the best peer when it answers) failed `errors` of 10."""
    rows = [
        results.make_row("chat", form, "vllm-router/round_robin", _summary(0.50), _workers([20, 20, 20, 20]), 0.82),
        results.make_row(
            "chat",
            form,
            setup,
            _summary(hit, errors=errors, p50=None if hit is None else 0.05),
            _workers([0] * 4),
            0.82,
        ),
        results.make_row("chat", form, "kvmesh", _summary(0.80), _workers([25, 22, 21, 22]), 0.82),
    ]
    return rows


@pytest.mark.parametrize("errors, hit", [(10, None), (9, 0.79), (1, 0.79)])
def test_a_peer_that_did_not_answer_every_request_is_a_named_miss(errors, hit):
    """A peer whose requests all failed drops out of 'best peer', and one that failed some is compared on the
    requests it answered: either way the comparison is not the one the targets mean, so the verdict misses and
    names the peer."""
    [v] = results.check_targets(_failing_peer_rows(errors, hit))
    assert v["checks"][results.PEERS_CHECK] is False and v["pass"] is False
    assert v["peers_failed"] == [f"vllm-router/cache_aware ({errors}/10 failed)"]
    line = results.format_verdicts([v])
    assert line.startswith("MISS  chat/tokens") and f"{results.PEERS_CHECK}: MISS" in line
    assert f"vllm-router/cache_aware ({errors}/10 failed)" in line


def test_only_a_setup_declared_unsupported_for_the_form_is_exempt():
    """sglang-router is declared unable to take token ids (`setups.UNSUPPORTED_FORMS`): its failures there are
    exempt; the same failures on text prompts, or with nothing declared, are a miss."""
    from kvmesh.benchmarks.peers import setups

    assert setups.UNSUPPORTED_FORMS == {"sglang-router/cache_aware": ("tokens",)}
    sg = "sglang-router/cache_aware"
    [v] = results.check_targets(_failing_peer_rows(10, None, "tokens", sg))
    assert v["checks"][results.PEERS_CHECK] is True and v["pass"] is True and v["peers_failed"] == []
    [v] = results.check_targets(_failing_peer_rows(10, None, "text", sg))
    assert v["checks"][results.PEERS_CHECK] is False and v["peers_failed"] == [f"{sg} (10/10 failed)"]
    [v] = results.check_targets(_failing_peer_rows(10, None, "tokens", sg), unsupported={})
    assert v["checks"][results.PEERS_CHECK] is False and v["pass"] is False


@pytest.mark.parametrize("workers", [2, 4])
def test_the_saved_peer_runs_are_shown_as_the_current_checks_judge_them(workers):
    """docs/results/peers-n{2,4}.json keep the verdicts made when they were saved (`targets`, an earlier check
    set); judged again with today's `check_targets`, the verdicts stored beside them (`targets_current_checks`)
    and every verdict line docs/peers.md shows for them must be what the current checks say of the saved rows."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    doc = json.loads((root / "docs" / "results" / f"peers-n{workers}.json").read_text())
    now = results.check_targets(doc["rows"])
    assert doc["targets_current_checks"] == now
    shown = (root / "docs" / "peers.md").read_text()
    for line in results.format_verdicts(now).splitlines():
        assert line in shown, line
    if not all(v["pass"] for v in now):
        assert f"`targets_current_checks`\nin `peers-n{workers}.json`" in shown


def test_kvmesh_runs_right_after_its_peers_on_each_workload_with_their_servers_stopped(monkeypatch, tmp_path):
    """kvmesh ran after every peer of every workload, minutes after the peers it is compared with, so a
    drifting machine decided the TTFT ratio; now each workload and form runs its peers then kvmesh, and the
    peers' servers are stopped while kvmesh's engines run (and started again for the next peers). Servers,
    peers and kvmesh are faked."""
    from kvmesh.benchmarks.peers import engines, run
    from kvmesh.benchmarks.peers.engines import EngineSpec

    events: list[tuple] = []
    up: list[bool] = [False]

    def start_servers(n, spec, work_dir, **kwargs):
        up[0] = True
        events.append(("start",))
        return ["s"] * n

    def stop_servers(servers):
        if servers:
            up[0] = False
            events.append(("stop",))

    def run_peer(setup, records, cfg, servers, seed, workload, form, bound):
        assert up[0], "a peer ran without its servers"
        events.append(("peer", workload, form, setup.name, seed))
        return {"workload": workload, "form": form, "setup": setup.name}

    def run_kvmesh(workload, form, records, cfg, bound):
        assert not up[0], "kvmesh ran beside the peers' servers"
        events.append(("kvmesh", workload, form))
        return {"workload": workload, "form": form, "setup": run.KVMESH}

    monkeypatch.setattr(engines, "start_servers", start_servers)
    monkeypatch.setattr(engines, "stop_servers", stop_servers)
    monkeypatch.setattr(run, "run_peer", run_peer)
    monkeypatch.setattr(run, "run_kvmesh", run_kvmesh)
    peers = ("vllm-router/round_robin", "vllm-router/cache_aware")
    cfg = run.BenchConfig(
        spec=EngineSpec(model="x"),
        work_dir=tmp_path,
        workers=2,
        workloads=("chat", "flood"),
        setups=(*peers, run.KVMESH),
        cold="reseed",
        log=lambda *a: None,
    )
    rows, _ = run.run(cfg)
    cells = [(w, f) for w in ("chat", "flood") for f in run.FORMS]
    want: list[tuple] = []
    seed = 0
    for w, f in cells:
        want.append(("start",))
        for p in peers:
            seed += 1
            want.append(("peer", w, f, p, seed))
        want += [("stop",), ("kvmesh", w, f)]
    assert events == want
    assert len(rows) == len(cells) * 3


@pytest.mark.parametrize("given", [None, "/tmp/callers-ray"])
@pytest.mark.parametrize("fails", [False, True])
def test_run_kvmesh_puts_the_callers_ray_tmpdir_back(monkeypatch, tmp_path, given, fails):
    """kvmesh's app gets its Ray folder in the work dir, and the caller's RAY_TMPDIR (or its absence) is back
    afterwards, whether the app ran or failed to start: a later Ray app of the same process must not land in
    the bench's removed folder."""
    from kvmesh.benchmarks.peers import run
    from kvmesh.benchmarks.peers.engines import EngineSpec
    from kvmesh.deployments import app

    if given is None:
        monkeypatch.delenv("RAY_TMPDIR", raising=False)
    else:
        monkeypatch.setenv("RAY_TMPDIR", given)
    seen: list[str | None] = []

    def start_local(config, num_cpus=None):
        seen.append(os.environ.get("RAY_TMPDIR"))
        if fails:
            raise RuntimeError("no app")
        return "http://127.0.0.1:1"

    monkeypatch.setattr(app, "start_local", start_local)
    monkeypatch.setattr(app, "stop_local", lambda: None)
    monkeypatch.setattr(run, "_prediction", lambda url, key: {})
    monkeypatch.setattr(run, "_prediction_delta", lambda url, key, before: {})
    monkeypatch.setattr(run, "_replay", lambda *a, **k: {"per_replica": {}})
    monkeypatch.setattr(run.results, "workers_from_replay", lambda per_replica, n: [])
    monkeypatch.setattr(run.results, "make_row", lambda *a: {"setup": run.KVMESH})
    cfg = run.BenchConfig(spec=EngineSpec(model="x"), work_dir=tmp_path, workers=2, log=lambda *a: None)
    if fails:
        with pytest.raises(RuntimeError, match="no app"):
            run.run_kvmesh("chat", "tokens", [], cfg, 1.0)
    else:
        assert run.run_kvmesh("chat", "tokens", [], cfg, 1.0)["setup"] == run.KVMESH
    assert seen == [given if given is not None else str(tmp_path / "ray")]
    assert os.environ.get("RAY_TMPDIR") == given

"""The ingress throughput bench's pure parts on made-up data: requests/s and quantiles, the per-stage
breakdown from two sets of /kvmesh/state answers (summed over ingress replicas, the hop derived),
CPU shares, the verdicts, and BENCH=scale picking the bench up."""

from __future__ import annotations

import types

import pytest

from kvmesh.benchmarks import run_all
from kvmesh.benchmarks.bench_ingress_throughput import (
    breakdown,
    checks,
    cpu_shares,
    engine_steps,
    load_summary,
    median_phase,
    per_ingress_requests,
    process_kind,
    prompt_maker,
    ratios,
    requests_per_step,
    sync_traffic,
)


def _state(requests, decisions, decision_s, **stages):
    """One ingress replica's /kvmesh/state: stages as name=(seconds_total, count)."""
    return {
        "router": {"decisions": decisions, "decision_s_total": decision_s},
        "serving": {
            "total": {"requests": requests},
            "stages": {k: {"seconds_total": s, "count": n} for k, (s, n) in stages.items()},
        },
    }


def test_load_summary_counts_only_successes_over_the_wall_time():
    s = load_summary([0.01] * 90 + [0.05] * 10, errors=3, wall_s=2.0)
    assert s["rps"] == pytest.approx(50.0)  # 100 successes in 2 s; the 3 errors do not count
    assert s["p50_ms"] == pytest.approx(10.0)
    assert s["p90_ms"] == pytest.approx(10.0) and s["errors"] == 3
    assert load_summary([], 0, 0.0)["rps"] == 0.0


def test_breakdown_sums_replicas_and_derives_the_hop():
    before = {
        "1": _state(10, 10, 0.01, engine_call=(0.1, 10), engine_first_output=(0.05, 10), tokenize=(0.0, 10)),
    }
    after = {
        # replica 1 served 100 more, replica 2 (new in the answer set) 100
        "1": _state(110, 110, 0.11, engine_call=(1.1, 110), engine_first_output=(0.55, 110), tokenize=(0.1, 110)),
        "2": _state(100, 100, 0.3, engine_call=(2.0, 100), engine_first_output=(0.5, 100), tokenize=(0.1, 100)),
    }
    b = breakdown(before, after)
    assert b["engine_call"] == pytest.approx(1000 * 3.0 / 200)  # 15 ms
    assert b["decision"] == pytest.approx(1000 * 0.4 / 200)  # 2 ms
    assert b["engine_first_output"] == pytest.approx(1000 * 1.0 / 200)  # 5 ms
    assert b["hop"] == pytest.approx(15 - 2 - 5)
    assert b["tokenize"] == pytest.approx(1.0) and b["handler"] is None  # never timed: no figure
    assert b["post_call"] is None  # needs the handler's time
    assert b["requests"] == 200
    assert per_ingress_requests(before, after) == [100, 100]


def test_no_engine_time_means_no_hop():
    after = {"1": _state(5, 5, 0.01, engine_call=(0.1, 5))}
    assert breakdown({}, after)["hop"] is None


def test_requests_per_engine_step_from_the_freshest_routing_stats():
    def states(*per_ingress):
        return {f"i{k}": {"router": {"routing_stats": stats}} for k, stats in enumerate(per_ingress)}

    # two ingress replicas see the same engines' stats, one of them a period older: the larger count is newer
    before = engine_steps(states({"a": {"steps": 10}, "b": {"steps": 5}}, {"a": {"steps": 8}, "b": {"steps": 5}}))
    after = engine_steps(states({"a": {"steps": 60}, "b": {"steps": 55}, "c": {"steps": 9}}, {"a": {"steps": 70}}))
    assert before == {"a": 10, "b": 5} and after == {"a": 70, "b": 55, "c": 9}
    # 110 steps on the replicas known at both readings (c joined in between); 165 requests
    assert requests_per_step(before, after, 165) == pytest.approx(1.5)
    assert requests_per_step(before, before, 10) is None  # nothing stepped: no figure
    assert engine_steps(states({"a": {"queued": 0}})) == {}  # a replica that reports no steps


def test_cpu_shares_are_cores_per_kind_over_the_phase():
    before = {1: ("ingress", 10.0), 2: ("engines", 5.0), 3: ("engines", 5.0)}
    after = {1: ("ingress", 12.0), 2: ("engines", 6.0), 3: ("engines", 6.5), 4: ("front", 0.5)}
    shares = cpu_shares(before, after, wall_s=2.0)
    assert shares == {"engines": 1.25, "front": 0.25, "ingress": 1.0}  # a process born in the phase counts whole


def test_process_kinds_from_ray_worker_titles():
    assert process_kind("ray::ServeReplica:kvmesh:Ingress", 7, 1) == "ingress"
    assert process_kind("ray::ServeReplica:kvmesh:EngineReplica", 7, 1) == "engines"
    assert process_kind("/usr/sbin/haproxy -f cfg", 7, 1) == "front"
    assert process_kind("python bench.py", 1, 1) == "client"
    assert process_kind("/x/raylet --foo", 7, 1) == "ray_other"


def _row(ingress, rps_tokens, rps_text=None, errors=0, sweep_errors=0, sync=True):
    forms = {"tokens": {"load": {"rps": rps_tokens, "errors": errors}}}
    if rps_text is not None:
        forms["text"] = {"load": {"rps": rps_text, "errors": 0}}
    row = {"ingress": ingress, "sync": sync, "forms": forms}
    if ingress == 1:
        row["sweep"] = [{"load": {"errors": sweep_errors}}]
    return row


def test_two_ingress_replicas_must_keep_nine_tenths_of_one():
    rows = [_row(1, 100.0, 80.0), _row(2, 91.0, 70.0), _row(4, 50.0, 40.0), _row(2, 20.0, 75.0, sync=False)]
    assert ratios(rows)["tokens"] == {"1": 1.0, "2": 0.91, "4": 0.5, "2 nosync": 0.2}
    verdict = dict(checks(rows))
    assert verdict["tokens: rps(2 ingress) >= 0.9 x rps(1 ingress)"]  # the synced run, not the contrast
    assert not verdict["text: rps(2 ingress) >= 0.9 x rps(1 ingress)"]  # 70/80 = 0.875; the contrast's 75 not used
    assert not any("rps(4" in name for name in verdict)  # reported, not judged
    assert verdict["ingress=2 nosync tokens: no failed request"]


def test_with_rounds_each_ratio_is_taken_within_a_round_and_the_median_judged():
    rounds = [
        # the machine slows down between rounds: across rounds 2 ingress over 1 would read 60/100 or 90/50
        [_row(1, 100.0), _row(2, 92.0)],
        [_row(2, 60.0), _row(1, 50.0)],
        [_row(1, 80.0), _row(2, 64.0)],
    ]
    rows = [{**r, "round": i} for i, rs in enumerate(rounds) for r in rs]
    assert ratios(rows)["tokens"]["2"] == pytest.approx(0.92)  # the median of 0.92, 1.2 and 0.8
    assert dict(checks(rows))["tokens: rps(2 ingress) >= 0.9 x rps(1 ingress)"]
    rows[0]["forms"]["tokens"]["load"]["errors"] = 1  # a failure in any round misses
    assert not dict(checks(rows))["ingress=1 tokens: no failed request"]


def test_the_median_phase_is_the_figure_and_every_phase_errors_count():
    runs = [
        {"load": {"rps": rps, "errors": err}, "stages_ms": {"decision": rps / 100}}
        for rps, err in ((150.0, 0), (120.0, 1), (170.0, 0))
    ]
    got = median_phase(runs)
    assert got["load"]["rps"] == 150.0 and got["stages_ms"]["decision"] == 1.5  # the median phase's own figures
    assert got["load"]["errors"] == 1 and got["phases_rps"] == [150.0, 120.0, 170.0]
    assert median_phase(runs[:2])["load"]["rps"] == 120.0  # the lower middle of an even count


def test_failed_requests_and_missing_runs_miss():
    verdict = dict(checks([_row(1, 100.0, sweep_errors=1), _row(4, 90.0, errors=2)]))
    assert not verdict["ingress=1 tokens: no failed request"]  # an error in the sweep counts
    assert not verdict["ingress=4 tokens: no failed request"]
    assert not verdict["tokens: rps(2 ingress) >= 0.9 x rps(1 ingress)"]  # no 2-ingress run


def test_prompts_are_fresh_and_short():
    tokens, text = prompt_maker("tokens", 0), prompt_maker("text", 0)
    a, b = tokens(), tokens()
    assert len(a) == 16 and a != b and all(isinstance(t, int) for t in a)
    assert text() != text()
    with pytest.raises(ValueError):
        prompt_maker("audio", 0)


def test_bench_scale_runs_the_ingress_throughput_and_overhead_benches(monkeypatch):
    ran = []
    names = ["bench_ingress_throughput", "bench_overhead", "bench_scale_live", "bench_tiers"]
    monkeypatch.setattr(run_all.pkgutil, "iter_modules", lambda path: [types.SimpleNamespace(name=n) for n in names])
    monkeypatch.setattr(run_all.importlib, "import_module", lambda m: types.SimpleNamespace(main=lambda: ran.append(m)))
    assert run_all.main(["scale"]) == 0
    assert ran == [
        "kvmesh.benchmarks.bench_ingress_throughput",
        "kvmesh.benchmarks.bench_overhead",
        "kvmesh.benchmarks.bench_scale_live",
    ]


def test_post_call_is_the_handler_less_what_came_before_and_the_call():
    after = {"1": _state(10, 10, 0.01, handler=(0.2, 10), pre_call=(0.03, 10), engine_call=(0.15, 10))}
    assert breakdown({}, after)["post_call"] == pytest.approx(2.0)  # 20 - 3 - 15 ms


def test_post_json_reads_status_and_body_and_keeps_the_connection():
    import asyncio

    from kvmesh.benchmarks.bench_ingress_throughput import post_json

    connections, bodies = [], []

    async def serve(reader, writer):
        connections.append(1)
        for status in (b"200 OK", b"429 Too Many Requests"):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            bodies.append(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 " + status + b'\r\nContent-Length: 7\r\nX-A: b\r\n\r\n{"a":1}')
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        got = [await post_json(*conn, head, b'{"n":1}'), await post_json(*conn, head, b"{}")]
        conn[1].close()
        server.close()
        return got

    assert asyncio.run(main()) == [200, 429]
    assert connections == [1] and bodies == [b'{"n":1}', b"{}"]


def _phase(rps, **stages):
    stage_ms = {k: None for k in ("tokenize", "pre_call", "engine_call", "decision", "engine_first_output")}
    stage_ms |= {"hop": None, "post_call": None, "handler": None, "outside_handler": None, **stages}
    load = {"rps": rps, "errors": 0, "p50_ms": 10.0, "p90_ms": 20.0}
    return {"load": load, "stages_ms": stage_ms, "cores": {"ingress": 0.5}, "per_ingress_requests": [400]}


def test_table_has_a_line_per_run_form_and_sweep_point():
    from kvmesh.benchmarks.bench_ingress_throughput import table

    rows = [
        {"ingress": 1, "forms": {"tokens": _phase(80.0, hop=3.5)}, "sweep": [{"concurrency": 4, **_phase(60.0)}]},
        {"ingress": 2, "forms": {"tokens": _phase(60.0)}},
        {"ingress": 2, "sync": False, "forms": {"tokens": _phase(40.0)}},
    ]
    offline = {
        "tokens": {"tokenize_us_mean": 0.0, "hash_us_mean": 5.0, "full_blocks_mean": 0.0, "prompt_tokens_mean": 16.0}
    }
    lines = table(rows, offline).splitlines()
    assert len(lines) == 1 + 3 + 1 + 1
    assert lines[1].startswith("1 tokens") and " 3.50 " in lines[1] and " 1.00 " in lines[1]
    assert lines[2].startswith("2 tokens") and " 0.75 " in lines[2]  # ratio to one ingress replica
    assert lines[3].startswith("2 nosync tokens") and " 0.50 " in lines[3]
    assert lines[4].startswith("1 tokens C=4")


def test_plot_writes_a_png(tmp_path):
    from kvmesh.benchmarks.bench_ingress_throughput import plot

    rows = [
        {"ingress": 1, "forms": {"tokens": _phase(80.0, hop=3.5), "text": _phase(60.0, decision=1.0)}},
        {"ingress": 2, "sync": False, "forms": {"tokens": _phase(40.0)}},
    ]
    plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    # with rounds: one line per round, the breakdown of the first
    again = [{**r, "round": 1} for r in rows]
    plot([{**r, "round": 0} for r in rows] + again, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_sync_traffic_sums_messages_and_frames_over_ingress_replicas():
    def st(published, frames):
        return {"router": {"sync": {"router": "x", "published": published, "frames": frames}}}

    before = {"a": st(10, 4), "b": st(0, 0)}
    after = {"a": st(40, 14), "b": st(30, 12)}
    assert sync_traffic(before, after) == {"messages": 60, "frames": 22}
    assert sync_traffic(after, after) is None  # nothing sent in the phase
    assert sync_traffic({"a": {}}, {"a": {"router": {}}}) is None  # no sync at all


def test_the_setups_measured_before_a_failing_one_are_on_disk(monkeypatch, tmp_path):
    """The JSON was written only after the last setup: a setup that failed lost every earlier one. Now each
    setup rewrites it, marked incomplete, and the failure still ends the bench with an error."""
    import json

    from kvmesh.benchmarks import bench_ingress_throughput as it

    calls = []

    def run_one(ingress, sync, forms, sweep=True):
        calls.append(ingress)
        if len(calls) == 3:
            raise RuntimeError("reached 3 of 4 ingress replicas (fake)")
        form = {"load": {"rps": 100.0, "errors": 0}, "phases_rps": [100.0]}
        return {"ingress": ingress, "sync": sync, "forms": {f: form for f in forms}}

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.delenv("BENCH_INGRESS_SETUPS", raising=False)
    monkeypatch.delenv("BENCH_INGRESS_ROUNDS", raising=False)
    monkeypatch.setattr(it, "run_one", run_one)
    monkeypatch.setattr(it, "offline_costs", lambda forms: {})
    with pytest.raises(RuntimeError):
        it.main()
    report = json.loads((tmp_path / "ingress_throughput" / "ingress_throughput.json").read_text())
    assert report["complete"] is False
    assert [r["ingress"] for r in report["rows"]] == [n for n, _ in it.SETUPS[:2]]
    assert not list((tmp_path / "ingress_throughput").glob("*.tmp"))

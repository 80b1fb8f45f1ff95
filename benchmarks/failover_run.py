"""A streaming conversation replay against a live kvmesh app, with an optional real `kill -9` of an
engine replica part-way through (the replica of whichever stream next receives its first token once the
given fraction of requests completed, however many streams it has open: not necessarily the busiest):
the shared driver of `bench_failover` and the failover integration test.

Workload: conversations whose every turn extends the previous turn's prompt (token-id prompts), so
turns hit the prefix cache of the replica that served the conversation; each of `concurrency`
workers runs whole conversations turn by turn. Every request streams (`/v1/completions`, greedy,
`ignore_eos`, fixed `max_tokens`). Once the given fraction of requests completed, the next stream to
receive a token has its replica killed (SIGKILL to the pid the replica reports in its routing stats)
right then, so the kill lands while that stream is still generating there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx


def conversations(n: int, turns: int, seed: int, first: int = 96, step: int = 64) -> list[list[list[int]]]:
    """`n` conversations of `turns` token-id prompts; turn t is turn t-1's prompt plus `step` new tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [rng.randrange(10, 1000) for _ in range(first + step * (turns - 1))]
        out.append([tokens[: first + step * t] for t in range(turns)])
    return out


@dataclass
class StreamResult:
    conversation: int
    turn: int
    status: int = 0
    text: str = ""
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None  # an error event or exception
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    finished_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


@dataclass
class RunReport:
    results: list[StreamResult]
    killed_replica: str | None = None
    killed_pid: int | None = None
    killed_after: int = 0  # completed requests when the kill was sent
    open_on_killed: int = 0  # streams open on that replica at the kill
    killed_children: list[int] = field(default_factory=list)  # its child processes (AsyncLLM's engine core)
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.results)

    def in_completion_order(self) -> list[StreamResult]:
        return sorted(self.results, key=lambda r: r.finished_at)

    def hit_rate(self, part: slice = slice(None)) -> float:
        """Token-weighted hit rate (cached / prompt tokens) of the requests in `part` of completion order."""
        chosen = self.in_completion_order()[part]
        prompt = sum(r.prompt_tokens for r in chosen)
        return sum(r.cached_tokens for r in chosen) / prompt if prompt else 0.0

    def last_third_hit_rate(self) -> float:
        n = len(self.results)
        return self.hit_rate(slice(n - n // 3, None))

    def to_json(self) -> dict:
        return {
            "failed": self.failed,
            "killed_replica": self.killed_replica,
            "killed_pid": self.killed_pid,
            "killed_after": self.killed_after,
            "open_on_killed": self.open_on_killed,
            "killed_children": self.killed_children,
            "wall_s": self.wall_s,
            "hit_rate": self.hit_rate(),
            "last_third_hit_rate": self.last_third_hit_rate(),
            **self.extra,
            "results": [asdict(r) for r in self.results],
        }


def stream_one(
    client: httpx.Client, prompt: list[int], max_tokens: int, result: StreamResult, on_replica, on_token=None
) -> None:
    """One streamed completion into `result`; `on_replica(replica, +1/-1)` brackets the stream and
    `on_token(replica, n)` follows each event that carried text (`n`: such events so far, this one too)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = r.read().decode(errors="replace")[:300]
                return
            result.replica = r.headers.get("x-kvmesh-replica", "")
            on_replica(result.replica, +1)
            try:
                parts: list[str] = []
                texts = 0
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        result.done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = json.dumps(event["error"])[:300]
                        break
                    for choice in event.get("choices") or []:
                        parts.append(choice.get("text") or "")
                        if choice.get("text"):
                            texts += 1
                            if on_token is not None:
                                on_token(result.replica, texts)
                    usage = event.get("usage")
                    if usage:
                        result.prompt_tokens = usage["prompt_tokens"]
                        result.completion_tokens = usage["completion_tokens"]
                        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                result.text = "".join(parts)
            finally:
                on_replica(result.replica, -1)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"


def _children(pid: int) -> list[int]:
    """Process ids below `pid` (an engine replica's own processes, such as AsyncLLM's engine core)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def surviving(pids: list[int], within_s: float) -> list[int]:
    """Those of `pids` still running (not zombies) `within_s` seconds from now."""
    import psutil

    from kvmesh.deployments.process_tree import still_running

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return [p.pid for p in still_running(procs, within_s)]


def replica_pids(client: httpx.Client) -> dict[str, int]:
    """Engine replica id -> its process id, as the replicas report it to the router."""
    state = client.get("/kvmesh/state").json()["router"] or {}
    return {rid: s["pid"] for rid, s in (state.get("routing_stats") or {}).items() if s.get("pid")}


def pid_of(client: httpx.Client, replica: str, timeout_s: float = 60.0) -> int:
    """The process id of `replica`, waiting for its first routing stats: a replica can serve a request
    before the router has heard from it."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid = replica_pids(client).get(replica)
        if pid is not None:
            return pid
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica} reported no process id within {timeout_s:.0f} s")
        time.sleep(0.5)


def metric(client: httpx.Client, name: str) -> float:
    """An unlabelled sample of `name` from /metrics (0 when absent)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run(
    url: str,
    headers: dict,
    convs: list[list[list[int]]],
    *,
    concurrency: int,
    max_tokens: int,
    kill_at: float | None = None,
    timeout_s: float = 300.0,
) -> RunReport:
    """Replay `convs`; with `kill_at`, SIGKILL a replica mid-stream once that fraction completed."""
    total = sum(len(c) for c in convs)
    results = [StreamResult(ci, t) for ci, conv in enumerate(convs) for t in range(len(conv))]
    by_conv: dict[int, list[StreamResult]] = {}
    for r in results:
        by_conv.setdefault(r.conversation, []).append(r)
    queue = list(range(len(convs)))
    lock = threading.Lock()
    open_streams: Counter[str] = Counter()
    report = RunReport(results)
    done = 0

    def on_replica(replica: str, delta: int) -> None:
        with lock:
            open_streams[replica] += delta

    pids: dict[str, int] = {}

    def learn_pids() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            pids.update(replica_pids(c))

    if kill_at is not None:
        learn_pids()

    def maybe_kill(replica: str, texts: int) -> None:
        """Once `kill_at` of the requests completed, SIGKILL the replica of the stream that just received
        its first text: the kill lands while that stream still has all but one of its tokens to generate
        there (the replicas' pids are known beforehand, so nothing delays the kill)."""
        with lock:
            if kill_at is None or report.killed_pid is not None or done < kill_at * total or texts != 1:
                return
            if replica not in pids:  # a replica that started after the run began
                learn_pids()
            if replica not in pids:
                return
            report.killed_replica, report.killed_pid = replica, pids[replica]
            report.killed_after, report.open_on_killed = done, open_streams[replica]
            report.killed_children = _children(report.killed_pid)
            os.kill(report.killed_pid, signal.SIGKILL)

    def worker() -> None:
        nonlocal done
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    ci = queue.pop(0)
                for turn, prompt in enumerate(convs[ci]):
                    res = by_conv[ci][turn]
                    stream_one(client, prompt, max_tokens, res, on_replica, maybe_kill)
                    res.finished_at = time.monotonic()
                    with lock:
                        done += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.wall_s = time.monotonic() - t0
    return report

"""The replay client (deployments/replay.py, `kvmesh replay`) on plain data: prompt expansion, result
aggregation, argument and connection errors. Replays against a real vLLM server are in
tests/integration/test_replay_vllm_server.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.cluster.ports import free_port
from kvmesh.deployments.cli import main as cli
from kvmesh.deployments.replay import (
    PromptBuilder,
    ReplayConfig,
    ReplayError,
    ReplayReport,
    RequestResult,
    format_table,
    one_token_words,
)


def _rec(ids, length=None, **extra):
    return {"timestamp": 0, "input_length": length or len(ids) * 512, "output_length": 512, "hash_ids": ids, **extra}


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny local model, built once per machine (idempotent, safe under concurrent builders)."""
    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")


# ------------------------------------------------------------------------------------ unit
def test_shared_ids_give_identical_token_prefixes():
    b = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32))
    p1 = b.prompt(_rec([1, 2, 3]))
    p2 = b.prompt(_rec([1, 2, 4], 2 * 512 + 128))
    assert len(p1) == 96 and len(p2) == 64 + 8
    assert p1[:64] == p2[:64] and p1[64:72] != p2[64:]
    assert PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32)).prompt(_rec([1, 2, 3])) == p1
    assert all(10 <= t < 260 for t in p1)
    partial = b.prompt(_rec([1, 2, 3], 2 * 512 + 256))  # a partial block is a prefix of the full one
    assert partial == p1[:80]
    other_seed = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32, seed=1)).prompt(_rec([1, 2, 3]))
    assert other_seed != p1 and len(other_seed) == 96


def test_text_form_is_prefix_stable(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    words = one_token_words(tok)
    assert len(words) >= 50
    b = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32, prompt_form="text", tokenizer=str(tiny_model)))
    t1, t2 = b.prompt(_rec([5, 6, 7])), b.prompt(_rec([5, 6, 8], 2 * 512 + 100))
    ids1 = tok.encode(t1, add_special_tokens=False)
    ids2 = tok.encode(t2, add_special_tokens=False)
    assert len(ids1) == 96 and len(ids2) == b.prompt_len(_rec([5, 6, 8], 2 * 512 + 100))
    assert ids1[:64] == ids2[:64] and ids1[64:70] != ids2[64:70]


def test_token_range_from_tokenizer_skips_special_tokens(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    b = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=64, tokenizer=str(tiny_model)))
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    toks = b.prompt(_rec(list(range(40))))
    assert not special & set(toks) and max(toks) < len(tok)


def test_config_errors():
    with pytest.raises(ReplayError, match="tokenizer"):
        ReplayConfig(url="u", prompt_form="text").check()
    with pytest.raises(ReplayError, match="not both"):
        ReplayConfig(url="u", concurrency=2, time_scale=1.0).check()
    with pytest.raises(ReplayError, match="prompt form"):
        ReplayConfig(url="u", prompt_form="chat").check()


def _res(i, prompt, cached, ttft, replica="r0", error=None):
    return RequestResult(i, None, None, prompt, cached, 4, ttft, (ttft or 0) + 0.1, replica, error)


def test_summary_aggregates_tokens_requests_replicas_and_errors():
    report = ReplayReport(
        [
            _res(0, 100, 0, 0.1, "a"),
            _res(1, 100, 50, 0.2, "b"),
            _res(2, 200, 200, 0.3, "a"),
            _res(3, 100, None, None, "b", error="HTTP 400: bad"),
        ],
        wall_s=2.0,
    )
    s = report.summary()
    assert s["requests"] == 4 and s["errors"] == 1 and s["error_samples"] == ["HTTP 400: bad"]
    assert s["hit_rate_tokens"] == pytest.approx(250 / 400)
    assert s["hit_rate_requests"] == pytest.approx((0 + 0.5 + 1.0) / 3)
    assert s["uncached_prompt_tokens"] == 150
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p90_s"] == pytest.approx(0.3)  # nearest rank
    assert s["throughput_tokens_s"] == pytest.approx((400 + 12) / 2.0)
    assert s["per_replica"]["a"] == {
        "requests": 2,
        "prompt_tokens": 300,
        "cached_tokens": 200,
        "uncached_prompt_tokens": 100,
        "hit_rate_tokens": pytest.approx(2 / 3),
    }
    assert s["per_replica_known"] is True
    assert s["uncached_max_over_mean"] == pytest.approx(100 / 75)
    table = format_table({"kvmesh": s, "round_robin": s})
    assert "62.5%" in table and "round_robin" in table and "a: 2 req" in table


def _fleet(replicas: int, busy: dict[str, tuple[int, int, int]]) -> dict:
    """A summary whose per-replica rows are idle but for `busy` (replica -> requests, prompt, cached)."""
    rows = {}
    for i in range(replicas):
        n, prompt, cached = busy.get(f"r{i}", (0, 0, 0))
        hit = cached / prompt if prompt else 0.0
        rows[f"r{i}"] = {
            "requests": n,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "uncached_prompt_tokens": prompt - cached,
            "hit_rate_tokens": hit,
        }
    return {"requests": 3, "per_replica_known": True, "per_replica": rows}


def test_a_large_fleets_per_replica_figures_are_a_bounded_summary():
    """`kvmesh demo --simulate --replicas 100000` listed every replica on one line (megabytes)."""
    s = _fleet(100_000, {"r7": (2, 1000, 800), "r99999": (1, 500, 0)})
    table = format_table({"kvmesh": s, "round_robin": s})
    assert len(table) < 4000, f"{len(table):,} characters for two runs"
    line = next(x for x in table.splitlines() if x.startswith("  kvmesh per replica"))
    assert "100,000 replicas" in line
    assert "requests 0/0/2" in line and "hit 0%/0%/80%" in line and "uncached 0/0/500" in line  # min/median/max
    assert line.index("r7: 2 req 80% hit 200 uncached") < line.index("r99999: 1 req 0% hit 500 uncached")


def test_a_small_fleets_replicas_are_each_listed():
    table = format_table({"kvmesh": _fleet(16, {"r3": (4, 100, 25)})})
    line = next(x for x in table.splitlines() if "per replica" in x)
    assert line.count(" req ") == 16 and "r3: 4 req 25% hit 75 uncached" in line and "r0: 0 req 0% hit" in line


def test_summary_without_cached_counts_reports_none():
    s = ReplayReport([_res(0, 100, None, 0.1, "unknown")], wall_s=1.0).summary()
    assert s["hit_rate_tokens"] is None and s["uncached_prompt_tokens"] is None
    assert s["per_replica_known"] is False


def test_a_replicas_row_counts_only_requests_whose_cached_tokens_came_back():
    """As the totals do: a request without the count says nothing of its hits; counted as 0 cached, it
    made that replica look colder than it was (a fleet where some servers do not report the field)."""
    s = ReplayReport([_res(0, 100, 80, 0.1, "a"), _res(1, 100, None, 0.1, "a")], wall_s=1.0).summary()
    assert s["hit_rate_tokens"] == pytest.approx(0.8)
    assert s["per_replica"]["a"]["hit_rate_tokens"] == pytest.approx(0.8) and s["per_replica"]["a"]["requests"] == 2


def test_cli_unreachable_url_is_one_line_exit_2(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    wl.write_jsonl([_rec([1, 2])], trace)
    port = free_port()
    assert (
        cli(
            [
                "replay",
                "--url",
                f"http://127.0.0.1:{port}",
                "--trace",
                str(trace),
                "--json",
                str(tmp_path / "o.json"),
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: kvmesh replay: cannot reach") and "\n" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace", "/nonexistent.jsonl"], "no such file"),
        (["--trace", "conversation", "--concurrency", "2", "--time-scale", "1"], "not allowed with"),
        (["--trace", "conversation", "--tenant-key", "nokey"], "TENANT=KEY"),
        (["--trace", "conversation", "--max-prompt-tokens", "1"], "no requests"),
    ],
)
def test_cli_argument_errors(argv, message, tmp_path, capsys):
    assert cli(["replay", "--url", "http://127.0.0.1:9", "--json", str(tmp_path / "o.json"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


# ----------------------------------------------------------------------------- integration
CHAT = wl.ChatSpec(tenants=1, groups=2, users=2, turns=3, system_blocks=6, seed=11)


def _sent_body(rec: dict, **cfg_kw) -> dict:
    """The body `_one_request` sends for `rec` (captured; no server)."""
    import asyncio

    from kvmesh.deployments.replay import _one_request

    captured: dict = {}

    class Captured(Exception):
        pass

    class Client:
        def stream(self, method, url, json=None, headers=None):
            captured.update(json)
            raise Captured

    cfg = ReplayConfig(url="http://x", model="tiny", **cfg_kw)
    result = asyncio.run(_one_request(Client(), cfg, "tiny", rec, 0, PromptBuilder(cfg), 0.0))
    assert result.error is not None and "Captured" in result.error
    return captured


def test_a_logged_body_is_sent_greedy_whatever_sampling_it_logged():
    """cachetest's correctness check compares warm outputs with cold's: a logged temperature 0.7 and top_p
    overrode the client's temperature 0, so both passes sampled and differed by chance."""
    logged = {
        "model": "app-model",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "n": 2,
        "max_tokens": 8,
        "presence_penalty": 0.5,
        "stop": ["\n"],
    }
    body = _sent_body({"body": logged, "tenant": "a", "user": "a/c0"})
    assert body["temperature"] == 0.0 and body["model"] == "app-model"
    assert not {"top_p", "top_k", "seed", "n"} & set(body)
    assert body["max_tokens"] == 8 and body["presence_penalty"] == 0.5 and body["stop"] == ["\n"]
    assert body["stream"] is True
    # a caller that wants the log's sampling says so
    assert _sent_body({"body": logged}, greedy=False)["temperature"] == 0.7
    # a trace record was and is sent at temperature 0
    assert _sent_body(_rec([1, 2]))["temperature"] == 0.0


class _Stream:
    """A streamed answer for `_one_request`: `chunks` as `data:` lines, each after its delay (s)."""

    def __init__(self, chunks: list[tuple[float, dict]], sent: dict):
        self.chunks, self.sent = chunks, sent
        self.status_code, self.headers = 200, {}

    def stream(self, method, url, json=None, headers=None):
        self.sent.update(body=json, headers=headers)
        return self

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def aiter_lines(self):
        import asyncio
        import json

        for delay, chunk in self.chunks:
            await asyncio.sleep(delay)
            yield "data: " + json.dumps(chunk)
        yield "data: [DONE]"


USAGE = {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 1}}


def _answer(rec: dict, chunks: list[tuple[float, dict]], **cfg_kw):
    """(`_one_request`'s result, what it sent) for `rec` answered with `chunks`."""
    import asyncio

    from kvmesh.deployments.replay import _one_request

    sent: dict = {}
    cfg = ReplayConfig(url="http://x", model="tiny", **cfg_kw)
    result = asyncio.run(_one_request(_Stream(chunks, sent), cfg, "tiny", rec, 0, PromptBuilder(cfg), 0.0))
    return result, sent


def test_a_numeric_tenant_is_sent_with_the_key_given_for_it():
    """A trace's tenant 1 is tenant "1" (its salt is its string form), and `--tenant-key 1=KEY` names it so: it
    went out under --api-key (another tenant's, or the wrong salt), or with no key at all."""
    chunks = [(0, {"choices": [{"text": "x"}]}), (0, USAGE)]
    for tenant in (1, "1", 1.5):
        keys = {"1": "KEY1", "1.5": "KEY15"}
        _, sent = _answer(_rec([1, 2], tenant=tenant), chunks, tenant_keys=keys, api_key="OTHER")
        assert sent["headers"]["Authorization"] == f"Bearer {keys[str(tenant)]}"
    _, sent = _answer(_rec([1, 2], tenant=2), chunks, tenant_keys={"1": "KEY1"}, api_key="OTHER")
    assert sent["headers"]["Authorization"] == "Bearer OTHER"  # a tenant without a key of its own


def test_ttft_is_taken_at_the_first_chunk_with_output_not_an_empty_one_before_it():
    """A server may stream an empty choice (a chat role delta, "" text) at once, before any token: TTFT was
    taken there, measuring the connection rather than the prefill."""
    first = 0.2
    for empty, token in (
        ({"choices": [{"text": ""}]}, {"choices": [{"text": "x"}]}),
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, {"choices": [{"delta": {"content": "x"}}]}),
    ):
        result, _ = _answer(_rec([1, 2]), [(0, empty), (first, token), (0, USAGE)])
        assert result.error is None and result.ttft_s >= first and result.output_text == "x"
    # an output that streamed no text at all still has a TTFT: its first choice
    result, _ = _answer(_rec([1, 2]), [(0.05, {"choices": [{"text": ""}]}), (0, USAGE)])
    assert result.error is None and 0.05 <= result.ttft_s < first


def _slow_server(delay_s: float):
    """A local OpenAI-like server answering each completion after `delay_s`, in a thread; (url, stop)."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, body: bytes, kind: str):
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(json.dumps({"data": [{"id": "fake"}]}).encode(), "application/json")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            time.sleep(delay_s)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
            chunks = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self._send(text.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_address[1]}", stop


def test_an_interrupted_replay_returns_the_requests_answered_before_it():
    """Ctrl-C (`asyncio.run` cancels the replay's task) lost every answered request; now the replay stops
    the ones in flight and returns the answered ones, the report marked partial."""
    import asyncio

    from kvmesh.deployments.replay import replay_async

    url, stop = _slow_server(0.05)
    recs = [dict(_rec([i]), output_length=16) for i in range(40)]
    cfg = ReplayConfig(url=url, tokens_per_block=16, concurrency=2, progress=False)

    async def interrupted():
        answered = asyncio.Event()
        done = []

        def on_result(res):
            done.append(res)
            if len(done) == 4:
                answered.set()

        task = asyncio.create_task(replay_async(recs, cfg, on_result))
        await answered.wait()
        task.cancel()
        return await task

    try:
        report = asyncio.run(interrupted())
    finally:
        stop()
    assert report.interrupted and 4 <= len(report.results) < len(recs)
    assert all(r.error is None for r in report.results)
    summary = report.summary()
    assert summary["partial"] is True and summary["records"] == 40 and summary["requests"] == len(report.results)
    assert "partial" not in ReplayReport(report.results, 1.0).summary()  # a run that ended says nothing


def test_kvmesh_replay_writes_an_interrupted_run_and_exits_130(tmp_path, monkeypatch, capsys):
    import json

    import kvmesh.deployments.replay as replay_mod

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(_rec([i])) + "\n" for i in range(5)))
    done = [RequestResult(i, None, None, 64, 32, 1, 0.1, 0.2, "r0") for i in range(2)]

    def interrupted(records, cfg, keep_partial=False):
        assert keep_partial  # the CLI keeps what was answered; the library raises KeyboardInterrupt as it did
        return ReplayReport(done, 1.0, "tiny", interrupted=True, records=len(records))

    monkeypatch.setattr(replay_mod, "replay", interrupted)
    out = tmp_path / "out.json"
    rc = cli(["replay", "--url", "http://127.0.0.1:1", "--trace", str(trace), "--json", str(out), "--no-progress"])
    assert rc == 130
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["requests"] == 2 and doc["records"] == 5
    assert "interrupted: 2 of 5 requests answered" in capsys.readouterr().err


def test_the_library_replay_still_raises_keyboard_interrupt_unless_asked_to_keep_partial(monkeypatch):
    """Callers of `replay` (the benchmarks) stop on Ctrl-C as before; `kvmesh replay` asks for the partial report."""
    import kvmesh.deployments.replay as replay_mod

    async def interrupted(records, cfg):
        return ReplayReport([], 1.0, interrupted=True, records=len(records))

    monkeypatch.setattr(replay_mod, "replay_async", interrupted)
    with pytest.raises(KeyboardInterrupt):
        replay_mod.replay([_rec([1])], ReplayConfig(url="http://x"))
    assert replay_mod.replay([_rec([1])], ReplayConfig(url="http://x"), keep_partial=True).interrupted

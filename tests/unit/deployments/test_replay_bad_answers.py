"""The replay client on answers it cannot use: a malformed usage, a models listing that is no OpenAI list, a stream
kept alive past the request deadline, a summary with no hit ratio. Each is that request's error or one line of
`kvmesh replay`, never a traceback that loses the run."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.deployments.cli import main as cli
from kvmesh.deployments.replay import (
    PromptBuilder,
    ReplayConfig,
    ReplayReport,
    RequestResult,
    _one_request,
    replay_async,
)


def _rec(ids, **extra):
    return {"timestamp": 0, "input_length": len(ids) * 512, "output_length": 16, "hash_ids": ids, **extra}


def _server(
    models: tuple[str, bytes], completion: Callable[[BaseHTTPRequestHandler, dict], None] | None = None
) -> tuple[str, Callable[[], None]]:
    """A local server: GET answers (content type, body) 200; POST calls `completion(handler, body)`. (url, stop)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            kind, body = models
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            assert completion is not None
            completion(self, body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{server.server_address[1]}", stop


MODELS = ("application/json", json.dumps({"data": [{"id": "fake"}]}).encode())


def _stream(handler: BaseHTTPRequestHandler, events: list[tuple[float, str]]) -> None:
    """Send an SSE answer: each (delay s, line) written after its delay; the connection closes at the end."""
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("connection", "close")
    handler.end_headers()
    for delay, line in events:
        time.sleep(delay)
        handler.wfile.write(f"{line}\n\n".encode())
        handler.wfile.flush()
    handler.close_connection = True


def _answer(usage: object) -> list[tuple[float, str]]:
    chunks = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}]
    return [(0.0, "data: " + json.dumps(c)) for c in chunks] + [(0.0, "data: [DONE]")]


@pytest.mark.parametrize(
    "usage, field",
    [
        ({"prompt_tokens": None, "completion_tokens": 1}, "prompt_tokens null"),
        ({"prompt_tokens": "n/a", "completion_tokens": 1}, 'prompt_tokens "n/a"'),
        ({"prompt_tokens": 64, "completion_tokens": -1}, "completion_tokens -1"),
        ({"prompt_tokens": 64, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": "x"}}, "cached"),
        ({"prompt_tokens": 64, "prompt_tokens_details": [1]}, "prompt_tokens_details"),
        (["not", "a", "mapping"], "malformed usage"),
    ],
)
def test_a_malformed_usage_is_that_requests_error(usage, field):
    from kvmesh.deployments.replay import usage_counts

    with pytest.raises(ValueError, match="malformed usage") as err:
        usage_counts(usage, 64, 1)
    assert field in str(err.value)


def test_usage_counts_keep_what_the_server_reported_and_default_what_it_left_out():
    from kvmesh.deployments.replay import usage_counts

    assert usage_counts({"prompt_tokens": 70, "completion_tokens": 3.0}, 64, 1) == (70, None, 3)
    assert usage_counts({"prompt_tokens_details": {"cached_tokens": 32}}, 64, 2) == (64, 32, 2)
    assert usage_counts({"prompt_tokens": 70, "prompt_tokens_details": None}, 64, 1) == (70, None, 1)


def test_one_malformed_usage_among_good_answers_leaves_the_run_whole():
    """A usage chunk with prompt_tokens null ended the whole replay in a traceback (every answer lost)."""
    good = {"prompt_tokens": 64, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 32}}
    posts = []
    lock = threading.Lock()

    def complete(handler, body):
        with lock:
            posts.append(body)
            third = len(posts) == 3
        _stream(handler, _answer({**good, "prompt_tokens": None} if third else good))

    url, stop = _server(MODELS, complete)
    cfg = ReplayConfig(url=url, tokens_per_block=16, concurrency=2, progress=False)
    try:
        report = asyncio.run(replay_async([_rec([i]) for i in range(6)], cfg))
    finally:
        stop()
    errors = [r.error for r in report.results if r.error is not None]
    assert len(report.results) == 6 and len(errors) == 1, errors
    assert errors[0].startswith("malformed usage: prompt_tokens null")
    assert report.summary()["cached_tokens"] == 5 * 32


def test_an_unexpected_failure_of_one_request_is_its_error_not_the_runs_end(monkeypatch):
    """The safety net: whatever one request's handling raises is that request's error."""
    import kvmesh.deployments.replay as replay_mod

    async def answer(client, cfg, model, rec, index, builder, run_t0):
        if index == 1:
            raise RuntimeError("something\nunforeseen")
        return RequestResult(index, None, None, 64, 0, 1, 0.01, 0.02, "r0")

    monkeypatch.setattr(replay_mod, "_one_request", answer)
    cfg = ReplayConfig(url="http://127.0.0.1:9", model="fake", concurrency=2, progress=False)
    report = asyncio.run(replay_async([_rec([i]) for i in range(4)], cfg))
    assert [r.error for r in sorted(report.results, key=lambda r: r.index)] == [
        None,
        "RuntimeError: something unforeseen",
        None,
        None,
    ]


@pytest.mark.parametrize(
    "kind, body",
    [
        (
            "text/html",
            b"<html><head><title>Dash</title></head><body><h1>Welcome</h1>\n<p>a dashboard</p></body></html>",
        ),
        ("application/json", b'[{"id": "m"}]'),
        ("application/json", b'{"data": [{"name": "m"}]}'),
        ("application/json", b'{"data": "m"}'),
        ("application/json", b""),
    ],
    ids=["html", "json-list", "no-id", "data-not-a-list", "empty"],
)
def test_a_models_listing_that_is_no_openai_list_is_one_line_exit_2(kind, body, tmp_path, capsys):
    url, stop = _server((kind, body))
    trace = tmp_path / "t.jsonl"
    wl.write_jsonl([_rec([1, 2])], trace)
    try:
        rc = cli(["replay", "--url", url, "--trace", str(trace), "--json", str(tmp_path / "o.json"), "--no-progress"])
    finally:
        stop()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err.startswith(f"error: kvmesh replay: GET {url}/v1/models answered with no OpenAI model list"), err
    assert not (tmp_path / "o.json").exists()


def test_the_timeout_is_a_deadline_for_the_whole_request_not_for_each_read():
    """A server that keeps the stream alive (SSE comments) or trickles tokens restarted httpx's read timeout with
    every byte: --timeout 0.5 against 3 s of keep-alives waited the 3 s and counted a success."""

    def complete(handler, body):
        try:
            _stream(handler, [(0.1, ": keep-alive")] * 30 + _answer({"prompt_tokens": 64, "completion_tokens": 1}))
        except OSError:  # the client gave up
            pass

    url, stop = _server(MODELS, complete)
    cfg = ReplayConfig(url=url, tokens_per_block=16, concurrency=2, timeout_s=0.5, progress=False)
    t0 = time.perf_counter()
    try:
        report = asyncio.run(replay_async([_rec([1]), _rec([2])], cfg))
    finally:
        stop()
    assert time.perf_counter() - t0 < 2.5
    assert [r.error for r in report.results] == ["timed out after 0.5 s"] * 2
    assert all(0.5 <= r.latency_s < 1.5 for r in report.results)


def test_a_fast_answer_is_not_cut_by_the_deadline():
    class Stream:
        status_code, headers = 200, {}

        def stream(self, method, url, json=None, headers=None):
            return self

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def aiter_lines(self):
            for _, line in _answer({"prompt_tokens": 64, "completion_tokens": 1}):
                yield line

    cfg = ReplayConfig(url="http://x", model="tiny", timeout_s=5)
    result = asyncio.run(_one_request(Stream(), cfg, "tiny", _rec([1]), 0, PromptBuilder(cfg), 0.0))
    assert result.error is None and result.prompt_tokens == 64


def test_a_summary_whose_answered_requests_all_report_no_prompt_tokens_has_no_request_hit_rate():
    """The mean of per-request ratios over no ratio at all raised StatisticsError (a traceback from the CLI)."""
    summary = ReplayReport([RequestResult(0, None, None, 0, 0, 1, 0.01, 0.02, "r1")], 1.0).summary()
    assert summary["hit_rate_requests"] is None and summary["hit_rate_tokens"] is None
    mixed = ReplayReport(
        [
            RequestResult(0, None, None, 0, 0, 1, 0.01, 0.02, "r1"),
            RequestResult(1, None, None, 10, 5, 1, 0.01, 0.02, "r1"),
        ],
        1.0,
    ).summary()
    assert mixed["hit_rate_requests"] == pytest.approx(0.5)

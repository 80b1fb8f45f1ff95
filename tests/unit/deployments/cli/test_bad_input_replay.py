"""`kvmesh replay` on bad input and failed runs: bad flags are one line and exit 2 before any request; a run
where every request failed writes its summary and exits 1; a server's error page becomes one line."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from kvmesh.cluster import workloads as wl
from kvmesh.deployments.cli import main
from kvmesh.deployments.replay import MAX_TOKENS_PER_BLOCK, PromptBuilder, ReplayConfig, ReplayError


class _Handler(http.server.BaseHTTPRequestHandler):
    """`GET /v1/models` names model "m" when `models` is set, else the standard 404 page; every POST gets
    the standard 501 page (as `python -m http.server` answers both)."""

    models = True

    def do_GET(self):
        if self.path == "/v1/models" and self.models:
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404, "File not found")

    def do_POST(self):
        self.send_error(501, "Unsupported method ('POST')")

    def log_message(self, *args):
        pass


def _serve(models: bool) -> Iterator[str]:
    handler = type("Handler", (_Handler,), {"models": models})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def failing_server() -> Iterator[str]:
    yield from _serve(models=True)


@pytest.fixture
def html_server() -> Iterator[str]:
    yield from _serve(models=False)


def _trace(tmp_path, n: int = 5) -> str:
    path = tmp_path / "t.jsonl"
    wl.write_jsonl(
        [{"timestamp": i, "input_length": 1024, "output_length": 16, "hash_ids": [i, i + 1]} for i in range(n)], path
    )
    return str(path)


def _replay(url: str, trace: str, out, *extra: str) -> int:
    return main(["replay", "--url", url, "--trace", trace, "--json", str(out), "--no-progress", *extra])


def test_every_request_failing_writes_the_summary_and_exits_1(failing_server, tmp_path, capsys):
    out = tmp_path / "o.json"
    assert _replay(failing_server, _trace(tmp_path), out) == 1
    summary = json.loads(out.read_text())
    assert summary["requests"] == summary["errors"] == 5
    stdout = capsys.readouterr().out
    assert "5 errors, e.g. HTTP 501: " in stdout and "<" not in stdout


def test_an_error_page_is_one_line(html_server, tmp_path, capsys):
    """No --model: the 404 page of GET /v1/models, its markup dropped, on the one line."""
    assert _replay(html_server, _trace(tmp_path), tmp_path / "o.json") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "<" not in err
    assert "/v1/models: HTTP 404: Error response Error code: 404 Message: File not found." in err


def test_a_long_error_message_is_one_bounded_line():
    from kvmesh.deployments.replay import _error_message

    message = _error_message(json.dumps({"error": {"message": "x\n" * 1000}}))
    assert message.startswith("x x x") and message.endswith("...") and len(message) == 300 and "\n" not in message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeout", "0"], "argument --timeout: must be a positive number, got '0'"),
        (
            ["--tokens-per-block", str(MAX_TOKENS_PER_BLOCK + 1)],
            f"argument --tokens-per-block: must be <= {MAX_TOKENS_PER_BLOCK:,}",
        ),
        (["--tokenizer", "/nonexistent"], "tokenizer /nonexistent: no such folder"),
    ],
)
def test_bad_flags_are_one_line_before_any_request(argv, message, failing_server, tmp_path, capsys):
    assert _replay(failing_server, _trace(tmp_path), tmp_path / "o.json", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o.json").exists()


def test_a_tokenizer_that_is_a_file_is_named(tmp_path):
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ReplayError, match="tok.json: not a folder"):
        PromptBuilder(ReplayConfig(url="http://x", tokenizer=str(tmp_path / "tok.json")))


def test_large_blocks_keep_fewer_blocks_cached():
    """The block cache is bounded in tokens: at the largest block it holds megabytes, not gigabytes."""
    small = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=32))
    large = PromptBuilder(ReplayConfig(url="http://x", tokens_per_block=MAX_TOKENS_PER_BLOCK))
    assert small._block.cache_info().maxsize == 65536
    assert large._block.cache_info().maxsize * MAX_TOKENS_PER_BLOCK <= 1 << 22


def test_the_config_refuses_what_the_flags_refuse():
    for cfg, message in [
        (ReplayConfig(url="http://x", tokens_per_block=MAX_TOKENS_PER_BLOCK + 1), "tokens per block must be <="),
        (ReplayConfig(url="http://x", timeout_s=0.0), "timeout must be > 0"),
    ]:
        with pytest.raises(ReplayError, match=message):
            cfg.check()


# ------------------------------------------------------------------------- the URL, empty values, the output


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://127.0.0.1:65536", "'http://127.0.0.1:65536': the port must be a whole number 1-65535"),
        ("http://127.0.0.1:99999", "'http://127.0.0.1:99999': the port must be a whole number 1-65535"),
        ("http://127.0.0.1:x", "the port must be a whole number 1-65535"),
        ("ftp://127.0.0.1:21", "expected an http:// or https:// URL"),
        ("http://", "'http://': no host"),
        ("http://h/v1?x=1", "a base URL has no query (?) or fragment (#)"),
        ("http://127.0.0.1:9\n", r"'http://127.0.0.1:9\n': a URL has no whitespace or control characters"),
        ("http://127.0.0.1:9\r\nx", r"'http://127.0.0.1:9\r\nx': a URL has no whitespace or control characters"),
        ("", "the URL is empty"),
    ],
)
def test_a_bad_url_is_one_clear_line_before_any_request(url, message, tmp_path, capsys):
    """Port 65536 was "cannot reach ...: ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)";
    a trailing newline split the message over two lines."""
    assert _replay(url, _trace(tmp_path), tmp_path / "o.json") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvmesh replay: argument --url: " in err and message in err, err
    assert "ExceptionGroup" not in err and not (tmp_path / "o.json").exists()


def test_the_replay_config_checks_the_url_too():
    with pytest.raises(ReplayError, match="the port must be a whole number 1-65535"):
        ReplayConfig(url="http://127.0.0.1:65536").check()
    ReplayConfig(url="https://[::1]:8000/prefix/").check()


@pytest.mark.parametrize("flag", ["--trace", "--api-key", "--tokenizer", "--model", "--label"])
def test_an_explicitly_empty_value_is_refused_not_taken_for_no_value(flag, failing_server, tmp_path, capsys):
    """`--api-key ""` (an unset shell variable) sent no key at all; `--model ""` asked the server for one."""
    argv = ["replay", "--url", failing_server, "--trace", _trace(tmp_path), "--json", str(tmp_path / "o.json")]
    assert main([*argv, "--no-progress", flag, ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}: expected a value, got an empty string" in err, err


@pytest.mark.parametrize("how", ["same", "link", "relative"])
def test_a_json_output_that_is_the_trace_is_refused_before_the_run(how, failing_server, tmp_path, capsys, monkeypatch):
    """The summary, written at the end, replaced the trace it was made from."""
    trace = _trace(tmp_path)
    before = open(trace).read()
    out = trace
    if how == "link":
        out = str(tmp_path / "out.json")
        (tmp_path / "out.json").symlink_to(trace)
    elif how == "relative":
        monkeypatch.chdir(tmp_path)
        out = "./t.jsonl"
    assert _replay(failing_server, trace, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the trace being read" in err, err
    assert open(trace).read() == before


def test_a_path_with_a_newline_is_echoed_on_one_line(failing_server, tmp_path, capsys):
    assert _replay(failing_server, str(tmp_path / "a\nb.jsonl"), tmp_path / "o.json") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a\\nb.jsonl" in err, err

"""`kvmesh cachetest` bad input is refused before the test runs (one line, exit 2); a test where every
request failed writes its report and exits 1. Nothing here needs a live server: `discover` is replaced."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from kvmesh.cluster.ports import free_port
from kvmesh.deployments.cli import main
from kvmesh.deployments.replay import MAX_TOKENS_PER_BLOCK


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the cachetest reaches its server."""

    def discover(cfg):
        raise AssertionError("the test ran")

    monkeypatch.setattr("kvmesh.deployments.cachetest.discover", discover)


@pytest.fixture
def served_m(monkeypatch):
    """The server at --url serves model "m" (and is not kvmesh): nothing answers there after that."""
    monkeypatch.setattr("kvmesh.deployments.cachetest.discover", lambda cfg: (["m"], False))


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

    return build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0")


def _log(tmp_path) -> str:
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"body": {"prompt": "hello there", "max_tokens": 2}}) + "\n")
    return str(log)


def _cachetest(*argv: str) -> int:
    return main(["cachetest", "--no-progress", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeout", "0"], "argument --timeout: must be a positive number, got '0'"),
        (["--uncached-rate", "1e308"], "argument --uncached-rate: must be <= 1e+06"),  # a cost of inf
        (
            ["--trace-tokens-per-block", str(MAX_TOKENS_PER_BLOCK + 1)],
            f"argument --trace-tokens-per-block: must be <= {MAX_TOKENS_PER_BLOCK:,}",
        ),
    ],
)
def test_bad_flags_are_refused_before_the_test(argv, message, no_work, tmp_path, capsys):
    rc = _cachetest("--url", "http://x", "--trace", "conversation", "--limit", "1", "--out", str(tmp_path / "o"), *argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("under", ["", "sub"])
def test_an_out_that_is_a_file_is_refused_before_the_test(under, no_work, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    out = taken / under if under else taken
    rc = _cachetest("--url", "http://x", "--requests", _log(tmp_path), "--out", str(out))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "argument --out" in err
    assert (f"{taken} is a file, not a folder" if not under else "cannot be written here") in err
    assert taken.read_text() == "keep me"


def test_a_missing_tokenizer_folder_is_named(served_m, tmp_path, capsys):
    """Not the hub's 'Repo id must use alphanumeric chars': a tokenizer here is a local folder."""
    rc = _cachetest(
        "--url", "http://x", "--requests", _log(tmp_path), "--out", str(tmp_path / "o"), "--tokenizer", "/nonexistent"
    )
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer /nonexistent: no such folder" in err and err.count("\n") == 1


def test_every_request_failing_writes_the_report_and_exits_1(served_m, tiny_model, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request fails to connect
    out = tmp_path / "o"
    rc = _cachetest("--url", url, "--requests", _log(tmp_path), "--out", str(out), "--tokenizer", str(tiny_model))
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    assert report["passes"] and all(p["errors"] == p["requests"] == 1 for p in report["passes"].values())


def test_a_chat_the_models_template_fails_on_is_one_line_naming_its_log_line(served_m, tiny_model, tmp_path, capsys):
    """Found once the log is rendered (the ingress answers it with a 400): one line, exit 2, not a traceback."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    )
    log = tmp_path / "log.jsonl"
    turn = {"role": "user", "content": "hi"}
    log.write_text(
        json.dumps({"body": {"messages": [turn]}}) + "\n" + json.dumps({"body": {"messages": [turn, turn]}}) + "\n"
    )
    rc = _cachetest(
        "--url", "http://x", "--requests", str(log), "--out", str(tmp_path / "o"), "--tokenizer", str(model)
    )
    err = capsys.readouterr().err
    assert rc == 2 and f"{log} line 2: the model's chat template refused it: one message only" in err
    assert err.count("\n") == 1


# ------------------------------------------------------------------- cheap checks before the expensive work


def _trace_file(tmp_path, n: int = 3, **extra) -> str:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i, "input_length": 1024, "output_length": 16, "hash_ids": [i, i + 1], **extra} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_unreachable_url_is_reported_before_any_prompt_is_built(monkeypatch, tmp_path, capsys):
    """A trace's prompts were built (at --trace-tokens-per-block 8192, over 30 s for `synthetic`) before the URL
    was contacted: the unreachable URL waited for them."""
    from kvmesh.deployments.cachetest import CachetestError
    from kvmesh.deployments.replay import PromptBuilder

    def unreachable(cfg):
        raise CachetestError(f"--url {cfg.url}: unreachable (ConnectError)")

    def built(self, rec):
        raise AssertionError("a prompt was built before the URL answered")

    monkeypatch.setattr("kvmesh.deployments.cachetest.discover", unreachable)
    monkeypatch.setattr(PromptBuilder, "prompt", built)
    rc = _cachetest(
        "--url",
        "http://127.0.0.1:9",
        "--trace",
        _trace_file(tmp_path),
        "--out",
        str(tmp_path / "o"),
        "--trace-tokens-per-block",
        str(MAX_TOKENS_PER_BLOCK),
    )
    err = capsys.readouterr().err
    assert rc == 2 and "unreachable (ConnectError)" in err and err.count("\n") == 1


def test_a_trace_is_still_sent_once_the_url_answers(served_m, tiny_model, tmp_path):
    """The prompts, built after the checks, are what is sent: every request fails to connect, report written."""
    out = tmp_path / "o"
    url = f"http://127.0.0.1:{free_port()}"
    rc = _cachetest(
        "--url",
        url,
        "--trace",
        _trace_file(tmp_path, tenant="a"),
        "--out",
        str(out),
        "--tokenizer",
        str(tiny_model),
        "--passes",
        "cold",
    )
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    assert report["passes"]["cold"]["requests"] == report["passes"]["cold"]["errors"] == 3


def test_a_tenant_without_a_key_in_a_trace_stops_before_the_url(no_work, tmp_path, capsys):
    rc = _cachetest(
        "--url",
        "http://x",
        "--trace",
        _trace_file(tmp_path, tenant="a"),
        "--out",
        str(tmp_path / "o"),
        "--tenant-key",
        "b=k",
    )
    err = capsys.readouterr().err
    assert rc == 2 and "tenant 'a' has no key" in err and err.count("\n") == 1


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_a_trace_without_records_is_bad_input_before_the_url(text, no_work, tmp_path, capsys):
    """An empty --requests log says "no requests"; an empty --trace went on to the URL (and to a report of
    nothing when it answered)."""
    trace = tmp_path / "empty.jsonl"
    trace.write_text(text)
    rc = _cachetest("--url", "http://x", "--trace", str(trace), "--out", str(tmp_path / "o"))
    err = capsys.readouterr().err
    assert rc == 2 and f"--trace '{trace}': no records" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--requests", "--trace", "--api-key", "--tokenizer", "--url"])
def test_an_explicitly_empty_value_is_refused_not_taken_for_no_value(flag, no_work, tmp_path, capsys):
    """`--requests ""` tested the bundled example log instead; `--api-key ""` sent no key."""
    argv = ["--url", "http://x", "--out", str(tmp_path / "o")]
    argv = ["--out", str(tmp_path / "o"), flag, ""] if flag == "--url" else [*argv, flag, ""]
    err = _refused(argv, capsys)
    assert f"argument {flag}: " in err and ("expected a value" in err or "the URL is empty" in err)


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://127.0.0.1:65536", "'http://127.0.0.1:65536': the port must be a whole number 1-65535"),
        ("http://127.0.0.1:99999", "the port must be a whole number 1-65535"),
        ("http://127.0.0.1:0", "the port must be a whole number 1-65535"),
        ("127.0.0.1:8000", "expected an http:// or https:// URL"),
        ("http://127.0.0.1:9\n", r"'http://127.0.0.1:9\n': a URL has no whitespace or control characters"),
        ("http:///v1", "no host"),
    ],
)
def test_a_bad_url_is_named_before_it_is_contacted(url, message, no_work, tmp_path, capsys):
    """Port 65536 was reported as `unreachable (ConnectError)`."""
    err = _refused(["--url", url, "--requests", _log(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert "kvmesh cachetest: argument --url: " in err and message in err


def test_a_path_with_a_newline_is_echoed_on_one_line(no_work, tmp_path, capsys):
    missing = str(tmp_path / "a\nb.jsonl")
    err = _refused(["--url", "http://x", "--requests", missing, "--out", str(tmp_path / "o")], capsys)
    assert "a\\nb.jsonl: cannot open" in err


def _refused(argv: list[str], capsys) -> str:
    assert _cachetest(*argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err

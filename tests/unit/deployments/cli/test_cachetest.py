"""`kvmesh cachetest` bad input: one line naming the line or the flag, exit status 2."""

import json

import pytest

from kvmesh.deployments.cli import main


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--url", "http://127.0.0.1:9"], "--url http://127.0.0.1:9: unreachable"),
        (["--url", "http://x", "--tenant-key", "t1=k"], "line 2: tenant 't2' has no key"),
        (["--url", "http://x", "--passes", "cold,hot"], "--passes: unknown pass 'hot'"),
        (["--url", "http://x", "--passes", ","], "--passes: name at least one pass"),
        (["--url", "http://x", "--replicas-sweep", "1,2"], "--replicas-sweep needs --serve"),
        (["--url", "http://x", "--concurrency-sweep", "1,x"], "expected comma-separated integers"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    log = tmp_path / "log.jsonl"
    log.write_text(
        json.dumps({"body": {"prompt": "hello"}, "tenant": "t1"})
        + "\n"
        + json.dumps({"body": {"prompt": "hi"}, "tenant": "t2"})
        + "\n"
    )
    rc = main(["cachetest", "--requests", str(log), "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("{oops", "line 2: not JSON"),
        (json.dumps({"body": {"prompt": "x"}, "endpoint": "/v1/embed"}), "unknown endpoint"),
        (
            json.dumps({"body": {"messages": [{"role": "user", "content": None}]}}),
            "line 2: messages[0].content must be a string or a list of text parts",
        ),
        (
            json.dumps({"body": {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]}}),
            "line 2: 'messages[0].tool_calls[0]' must be",
        ),
        (
            json.dumps({"body": {"messages": [{"role": "tool", "tool_call_id": "c1", "content": None}]}}),
            "line 2: messages[0].content must be a string or a list of text parts",
        ),
        (
            json.dumps({"body": {"messages": [{"role": "user", "content": "x"}], "tools": []}}),
            "line 2: 'tools' must not be an empty array",
        ),
    ],
)
def test_bad_log_lines_are_named(tmp_path, capsys, line, message):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"body": {"prompt": "ok"}}) + "\n" + line + "\n")
    rc = main(["cachetest", "--url", "http://127.0.0.1:9", "--requests", str(log), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and str(log) in err and err.count("\n") == 1


def _report(passes):
    """A report of four 74-token requests sent in each of `passes`: (name, cached tokens, TTFT s, error)."""
    from kvmesh.cluster.cachetest_analysis import Prepared, Sent
    from kvmesh.cluster.cachetest_report import PassRun, Rates, build_report
    from kvmesh.cluster.prefix_share import TokenizedRequest, hash_requests, offline_pass
    from kvmesh.cluster.request_log import LoggedRequest

    prepared = []
    for i in range(4):
        ids = list(range(100, 164)) + [900 + i] * 10
        req = LoggedRequest(f"r{i}", {"prompt": ids}, "/v1/completions", "a", f"c{i}")
        prepared.append(Prepared(req, TokenizedRequest(i, req.id, "a", None, ids)))
    hash_requests([p.tok for p in prepared], 32)
    runs = []
    for k, (name, cached, ttft, err) in enumerate(passes):
        sent = [
            Sent(
                p, name, 10.0 * k + i, None if err else 10.0 * k + i + ttft, p.tok.n, None if err else cached, "r0", err
            )
            for i, p in enumerate(prepared)
        ]
        runs.append(PassRun(name, sent, 4.0, 1))
    return build_report(runs, offline_pass([p.tok for p in prepared], 32), Rates(), 32)


def test_the_summary_names_its_pass_and_compares_cold_with_nothing(capsys):
    """--passes cold: the last line said "warm hit rate" of the cold pass (and the page compared cold's TTFT
    with itself, +0.0%)."""
    from kvmesh.deployments.cli.cachetest import _print_summary

    _print_summary(_report([("cold", 64, 0.2, None)]))
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("cold hit rate ") and "warm" not in last and "vs cold" not in last


def test_a_figure_not_measured_is_printed_as_n_a_not_as_zero(capsys):
    """Every warm request failed: no TTFT and no cost change, printed as 0.0 ms and +0.0%."""
    from kvmesh.deployments.cli.cachetest import _print_summary

    _print_summary(_report([("cold", 0, 0.5, None), ("warm", 0, None, "HTTP 503")]))
    lines = capsys.readouterr().out.splitlines()
    warm = next(line for line in lines if line.startswith("warm "))
    assert "TTFT p50     n/a ms" in warm and "0.0 ms" not in warm
    head = next(line for line in lines if line.startswith("warm hit rate"))  # the warnings follow it
    assert "input cost vs no cache n/a" in head and "+0.0%" not in head
    assert "TTFT p50 vs cold n/a (0 requests)" in head
    assert lines[-1] == (
        "warning: 4 of 4 requests of warm failed: the figures cover only the answered requests (see errors per tenant)"
    )


class _Tokenizer:
    """Enough of a tokenizer for a log of token-id prompts."""

    is_fast = False
    chat_template = None

    def __len__(self):
        return 1024

    def decode(self, ids):
        return " ".join(map(str, ids))


def _fake_server(monkeypatch, scale=1, interrupt_at=None):
    """The cachetest runner against a made-up server: a per-tenant block cache that counts `scale` prompt
    tokens per token sent; the `interrupt_at`-th replay is interrupted (Ctrl-C, or a SIGTERM unwound)."""
    import kvmesh.deployments.cachetest as ct
    import kvmesh.deployments.cli.cachetest as cli
    from kvmesh.deployments.replay import ReplayReport, RequestResult

    cache: set = set()
    calls = []

    def replay(records, cfg):
        calls.append(len(records))
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        out = []
        for i, rec in enumerate(records):
            ids = rec["body"]["prompt"]
            cached = 0
            for k in range(32, len(ids), 32):
                if (rec["tenant"], tuple(ids[:k])) not in cache:
                    break
                cached = k
            cache.update((rec["tenant"], tuple(ids[:k])) for k in range(32, len(ids) + 1, 32))
            out.append(
                RequestResult(i, rec["user"], rec["tenant"], scale * len(ids), scale * cached, 1, 0.1, 0.2, "r0")
            )
        return ReplayReport(out, 1.0)

    monkeypatch.setattr(ct, "discover", lambda cfg: (["tiny"], False))
    monkeypatch.setattr(ct, "reset_cache", lambda cfg: "/reset_prefix_cache")
    monkeypatch.setattr(ct, "replay", replay)
    monkeypatch.setattr(cli, "_tokenizer", lambda path: _Tokenizer())


def _log(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "body": {"prompt": [100 + i + j for j in range(80)]}}) + "\n" for i in range(4)
        )
    )
    return log


def test_an_interrupted_test_writes_the_passes_done_as_a_partial_report(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) in the warm pass left an earlier run's report.json and sweep plot in --out,
    looking like this run's result."""
    _fake_server(monkeypatch, interrupt_at=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"summary": {"pass": "warm", "hit_rate_tokens": 0.99}}')
    (out / "sweep_concurrency.png").write_bytes(b"earlier run")
    argv = ["cachetest", "--url", "http://x", "--requests", str(_log(tmp_path)), "--out", str(out)]
    rc = main([*argv, "--passes", "cold,warm", "--no-progress"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert list(rep["passes"]) == ["cold"] and rep["meta"]["partial"] == "interrupted, stopped in the warm pass"
    assert rep["summary"]["warning"].startswith("partial report (interrupted, stopped in the warm pass)")
    assert "<b id='partial'>PARTIAL: interrupted" in (out / "report.html").read_text()
    assert not (out / "sweep_concurrency.png").exists()


def test_a_server_counting_other_prompt_tokens_is_one_line_on_stderr_naming_tokenizer(tmp_path, monkeypatch, capsys):
    """The client tokenised with the default tiny model while the server served another: nothing said so."""
    _fake_server(monkeypatch, scale=2)
    argv = ["cachetest", "--url", "http://x", "--requests", str(_log(tmp_path)), "--out", str(tmp_path / "out")]
    assert main([*argv, "--passes", "cold,warm", "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the server counted") and "--tokenizer" in err[0]
    _fake_server(monkeypatch, scale=1)
    assert main([*argv, "--passes", "cold,warm", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""

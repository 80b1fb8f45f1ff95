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
    assert "input cost vs no cache n/a" in lines[-1] and "+0.0%" not in lines[-1]
    assert "TTFT p50 vs cold n/a (0 requests)" in lines[-1]

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

"""`kvmesh serve`'s API key stays off command lines and out of its output: it comes from --api-key-file or
KVMESH_API_KEY, reaches the driver through its environment, and a supplied key is printed only as a short
fingerprint (a generated one is printed once, as the only way its user learns it). Nothing here starts Ray."""

from __future__ import annotations

import argparse
import os
import signal
import threading

import pytest

from kvmesh.deployments.cli import main
from kvmesh.deployments.cli import serve as serve_cmd

KEY = "kvm-operator-supplied-key-0123456789"


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    """Neither key variable set, and whatever a test sets there removed after it."""
    for name in ("KVMESH_API_KEY", "KVMESH_SERVE_API_KEY"):
        monkeypatch.setenv(name, "")  # recorded as absent before, so the teardown removes it again
        monkeypatch.delenv(name)


class _StopAtOnce(threading.Event):
    """The stop event of a run whose stop signal already came: the banner is printed, then the stop."""

    def wait(self, timeout=None) -> bool:
        return True


def _banner(monkeypatch, capsys, argv: list[str]) -> str:
    """What `kvmesh serve`'s driver prints for `argv`, with the app's start and stop faked."""
    from kvmesh.deployments import app, process_tree

    monkeypatch.setattr(app, "start_local", lambda cfg, **kw: "http://127.0.0.1:8000")
    monkeypatch.setattr(app, "stop_local", lambda *a, **kw: None)
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: True)
    monkeypatch.setattr(serve_cmd.threading, "Event", _StopAtOnce)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    args = _args(argv)
    assert serve_cmd._drive(args, serve_cmd._build_config(args)) == 0
    return capsys.readouterr().out


def test_a_supplied_key_is_printed_only_as_a_fingerprint(monkeypatch, capsys):
    from kvmesh.deployments.tenants import hash_api_key

    out = _banner(monkeypatch, capsys, ["--api-key", KEY])
    assert KEY not in out
    assert f"API key fingerprint: sha256:{hash_api_key(KEY)[:12]}" in out


def test_a_generated_key_is_printed_once_for_its_user(monkeypatch, capsys):
    out = _banner(monkeypatch, capsys, [])
    printed = [line for line in out.splitlines() if line.startswith("API key: kvm-")]
    assert len(printed) == 1  # the form tests/support/serve_process.py reads the key from


def test_the_key_comes_from_a_file_and_stays_off_the_drivers_command_line(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"{KEY}\n")
    args = _args(["--api-key-file", str(path), "--port", "8123"])
    cfg = serve_cmd._build_config(args)
    assert cfg["api_keys"] == [KEY] and cfg["tenants_file"] is None
    flags = serve_cmd._flags(args)
    assert KEY not in " ".join(flags) and "--api-key-file" not in flags and "--port" in flags


def test_the_key_comes_from_kvmesh_api_key_and_leaves_the_environment(monkeypatch):
    monkeypatch.setenv("KVMESH_API_KEY", KEY)
    cfg = serve_cmd._build_config(_args([]))
    assert cfg["api_keys"] == [KEY]
    assert "KVMESH_API_KEY" not in os.environ  # Ray's processes, started from this one, must not inherit it


def test_a_key_in_the_environment_loses_its_trailing_newline_and_a_key_with_one_is_malformed(monkeypatch):
    """`export KVMESH_API_KEY="$(echo ...)"`-style values may end in a newline, which clients never send."""
    from kvmesh.deployments.tenants import ConfigError, TenantRegistry

    monkeypatch.setenv("KVMESH_API_KEY", KEY + "\n")
    assert serve_cmd._build_config(_args([]))["api_keys"] == [KEY]
    with pytest.raises(ConfigError, match="API key"):  # its hash would match no key a client sends
        TenantRegistry.single_key(KEY + "\n")


def test_the_relay_hands_a_file_key_to_the_driver_through_its_environment(monkeypatch, tmp_path):
    from kvmesh.deployments import supervisor

    path = tmp_path / "key"
    path.write_text(KEY)
    seen = {}

    def fake_supervise(argv):
        seen["argv"], seen["env"] = argv, os.environ.get(serve_cmd.DRIVER_KEY_ENV)
        return 0

    monkeypatch.setattr(supervisor, "supervise", fake_supervise)
    monkeypatch.setattr(supervisor, "is_driver", lambda: False)
    assert main(["serve", "--api-key-file", str(path), "--port", "0"]) == 0
    assert seen["env"] == KEY and KEY not in " ".join(seen["argv"]) and str(path) not in seen["argv"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file or directory"), ("", "is empty"), ("\n  \n", "is empty")],
)
def test_a_missing_or_empty_key_file_is_one_line_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    assert main(["serve", "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_key_and_a_key_file_together_are_refused(tmp_path, capsys):
    path = tmp_path / "key"
    path.write_text(KEY)
    assert main(["serve", "--api-key", KEY, "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not allowed with argument" in err, err

""".ci/run, the CI entry point, run from a copy with a stand-in `make` on PATH (one that starts a stand-in
pytest in its process group): it exits with make's status, and a SIGTERM to the script's pid alone (a job
cancelled, a timeout) reaches pytest as SIGINT, so its teardown runs, and leaves nothing running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO_ROOT

# make's stand-in: exits with FAKE_RC, or with FAKE_HOLD starts a pytest stand-in that runs until SIGINT
# and records its teardown, then exits as make does after a SIGINT.
FAKE_MAKE = """\
import os, pathlib, subprocess, sys
d = pathlib.Path(os.environ["FAKE_DIR"])
assert sys.argv[1:] == ["test"], sys.argv
if not os.environ.get("FAKE_HOLD"):
    sys.exit(int(os.environ["FAKE_RC"]))
(d / "make.pid").write_text(str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", PYTEST])
try:
    child.wait()
except KeyboardInterrupt:
    child.wait()
    sys.exit(130)
"""
FAKE_PYTEST = """\
import os, pathlib, time
d = pathlib.Path(os.environ["FAKE_DIR"])
(d / "pytest.pid.tmp").write_text(str(os.getpid()))
(d / "pytest.pid.tmp").rename(d / "pytest.pid")
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    (d / "pytest.teardown").touch()
    raise SystemExit(2)
"""


def _ci_copy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    (tmp_path / ".ci").mkdir()
    run = tmp_path / ".ci" / "run"
    shutil.copy2(REPO_ROOT / ".ci" / "run", run)
    (tmp_path / "bin").mkdir()
    make = tmp_path / "bin" / "make"
    make.write_text(f"#!{sys.executable}\nPYTEST = {FAKE_PYTEST!r}\n{FAKE_MAKE}")
    make.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}
    return run, env


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie has stopped running; its reaper may be slow


def _wait_for(check, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("make_rc", [0, 2])
def test_ci_run_exits_with_make_tests_status(tmp_path, make_rc):
    run, env = _ci_copy(tmp_path)
    done = subprocess.run([str(run)], env={**env, "FAKE_RC": str(make_rc)}, capture_output=True, timeout=60)
    assert done.returncode == make_rc, done.stderr


def test_sigterm_to_ci_run_reaches_pytest_as_sigint_and_leaves_nothing_running(tmp_path):
    run, env = _ci_copy(tmp_path)
    ci = subprocess.Popen([str(run)], env={**env, "FAKE_HOLD": "1"}, start_new_session=True)
    pids: list[int] = []
    try:
        _wait_for(lambda: (tmp_path / "pytest.pid").exists(), "the pytest stand-in never started")
        pids = [int((tmp_path / name).read_text()) for name in ("make.pid", "pytest.pid")]
        ci.send_signal(signal.SIGTERM)  # the script's pid only, not its process group
        assert ci.wait(timeout=30) == 130
        assert (tmp_path / "pytest.teardown").exists()
        for pid in pids:
            _wait_for(lambda: _gone(pid), f"{pid} was left running after .ci/run exited", within=20)
    finally:
        if ci.poll() is None:
            ci.kill()
            ci.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)

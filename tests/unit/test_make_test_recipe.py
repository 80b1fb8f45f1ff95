"""`make test`'s recipe, run from a copy of the Makefile's own `test` target text with stand-ins for pytest
(`$(PY)`) and the `typecheck` target: its exit status fails on any of the three (unit tests, integration
tests, type check) and only then, the type check's report follows the integration tests' output, its temp
file is removed, and Ctrl-C while the integration tests run lets pytest run its teardown and leaves no type
check running and no temp file behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO_ROOT

# The integration tests' stand-in: fails with FAKE_INTEG_RC, or with FAKE_HOLD waits for Ctrl-C and records
# its teardown as pytest's KeyboardInterrupt handling would run it.
FAKE_PYTEST = """\
import os, pathlib, sys, time
d = pathlib.Path(os.environ["FAKE_DIR"])
if "tests/unit" in sys.argv:
    sys.exit(int(os.environ["FAKE_UNIT_RC"]))
(d / "integration.started").touch()
print("integration tests' output", flush=True)
if os.environ.get("FAKE_HOLD"):
    try:
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        (d / "integration.teardown").touch()
        sys.exit(2)
sys.exit(int(os.environ["FAKE_INTEG_RC"]))
"""

# mypy's stand-in: records its pid, and with FAKE_HOLD runs until something stops it.
FAKE_MYPY = """\
import os, pathlib, sys, time
d = pathlib.Path(os.environ["FAKE_DIR"])
(d / "mypy.pid.tmp").write_text(str(os.getpid()))
(d / "mypy.pid.tmp").rename(d / "mypy.pid")
print("type check report", flush=True)
while os.environ.get("FAKE_HOLD"):
    time.sleep(0.05)
sys.exit(int(os.environ["FAKE_MYPY_RC"]))
"""

# Starts make with SIGINT at its default disposition, as a terminal's foreground job has it (a test worker
# may run with SIGINT ignored, which its children would inherit).
LAUNCH = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"


def _test_recipe() -> str:
    """The Makefile's `test` rule: its target line and recipe, up to the blank line after it."""
    text = (REPO_ROOT / "Makefile").read_text()
    start = text.index("\ntest: ") + 1
    return text[start : text.index("\n\n", start)] + "\n"


def _scripts(tmp_path: Path) -> tuple[Path, Path]:
    fake_py, fake_mypy = tmp_path / "fakepy", tmp_path / "fakemypy"
    for path, body in ((fake_py, FAKE_PYTEST), (fake_mypy, FAKE_MYPY)):
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return fake_py, fake_mypy


def _mock_makefile(tmp_path: Path) -> Path:
    fake_py, fake_mypy = _scripts(tmp_path)
    mk = tmp_path / "Makefile"
    # `cd . && ...; exit` keeps a shell between make and the stand-in, as the real typecheck recipe may.
    mk.write_text(
        "SHELL := /bin/bash\n"
        f"PY := {fake_py}\n"
        ".PHONY: setup services ruff typecheck test\n"
        "setup services ruff:\n\t@:\n"
        f"typecheck:\n\t@cd . && {fake_mypy}; exit $$?\n" + _test_recipe()
    )
    return mk


def _env(tmp_path: Path, **fake: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    (tmp_path / "tmp").mkdir()
    defaults = {"FAKE_UNIT_RC": "0", "FAKE_INTEG_RC": "0", "FAKE_MYPY_RC": "0"}
    return {**env, **defaults, **fake, "FAKE_DIR": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")}


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


@pytest.mark.parametrize(
    ("unit_rc", "integ_rc", "mypy_rc"),
    [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 0)],
)
def test_make_test_fails_when_any_step_fails_and_reports_the_type_check_last(tmp_path, unit_rc, integ_rc, mypy_rc):
    mk = _mock_makefile(tmp_path)
    env = _env(tmp_path, FAKE_UNIT_RC=str(unit_rc), FAKE_INTEG_RC=str(integ_rc), FAKE_MYPY_RC=str(mypy_rc))
    done = subprocess.run(
        ["make", "--no-print-directory", "-f", str(mk), "test"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (0 if (unit_rc, integ_rc, mypy_rc) == (0, 0, 0) else 2), done.stdout + done.stderr
    if unit_rc:
        assert not (tmp_path / "integration.started").exists()
    else:
        out = done.stdout
        assert out.index("integration tests' output") < out.index("type check report")
    assert os.listdir(tmp_path / "tmp") == []


def test_ctrl_c_during_the_integration_tests_stops_the_type_check_and_removes_its_report(tmp_path):
    mk = _mock_makefile(tmp_path)
    make = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "make", "--no-print-directory", "-f", str(mk), "test"],
        cwd=tmp_path,
        env=_env(tmp_path, FAKE_HOLD="1"),
        start_new_session=True,  # a process group of its own, as a terminal's foreground job
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    mypy_pid = None
    try:
        _wait_for(lambda: (tmp_path / "integration.started").exists(), "the integration tests never started")
        _wait_for(lambda: (tmp_path / "mypy.pid").exists(), "the type check never started")
        mypy_pid = int((tmp_path / "mypy.pid").read_text())
        os.killpg(make.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the foreground process group
        assert make.wait(timeout=30) != 0
        assert (tmp_path / "integration.teardown").exists()
        _wait_for(lambda: _gone(mypy_pid), "the type check was left running after make exited", within=20)
        assert os.listdir(tmp_path / "tmp") == []
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        if mypy_pid is not None and not _gone(mypy_pid):
            os.kill(mypy_pid, signal.SIGKILL)

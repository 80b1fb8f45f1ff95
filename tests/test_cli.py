"""The `kvmesh` entry point: bad arguments give one line on stderr and exit 2, never a traceback."""
import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "kvmesh.deployments.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_unknown_subcommand_is_one_line_exit_2():
    r = _run("frobnicate")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "frobnicate" in r.stderr


def test_no_subcommand_is_an_error():
    r = _run()
    assert r.returncode == 2 and "Traceback" not in r.stderr

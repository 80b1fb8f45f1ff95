"""`kvmesh` is the only top-level import name: the repository's folders install as `kvmesh.<folder>`.

Why: generic names such as `cluster` or `policies` collide in users' environments, and a module imported
under two names (`cluster.index` and `kvmesh.cluster.index`) is two modules with two sets of classes and
globals in one process (isinstance checks and module state silently split)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from paths import REPO_ROOT

ROOT = REPO_ROOT
FOLDER_NAMES = ("deployments", "kvstore", "policies", "cluster", "benchmarks")
# a dotted module path (optionally `:attr`) in a string: `-m` targets, import_module, Serve import paths
_FOLDER_PATH = re.compile(rf"^({'|'.join(FOLDER_NAMES)})(\.[a-z_]+)+(:\w+)?$")


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_only_kvmesh_is_installed_outside_the_repository(tmp_path):
    code = (
        "import importlib, sys\n"
        "import kvmesh.cluster.index\n"
        "assert kvmesh.cluster.index.PrefixIndex\n"
        f"for name in {FOLDER_NAMES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    sys.exit(f'{name} is importable outside the repository')\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_bundled_traces_ship_with_the_package(tmp_path):
    code = (
        "from importlib import resources\n"
        "print((resources.files('kvmesh.cluster') / 'traces' / 'mooncake_conversation_trace.jsonl').is_file())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]


def _sources():
    skip = {".venv", "out", "build", ".git"}
    for path in sorted(ROOT.rglob("*.py")):
        if not skip.intersection(path.relative_to(ROOT).parts):
            yield path


def test_no_code_uses_a_bare_folder_name():
    """Every import, and every module path in a string, names `kvmesh.<folder>`: then nothing (Ray Serve's
    import paths, `python -m`, importlib) can load a module a second time under its folder name."""
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _FOLDER_PATH.match(node.value):
                names = [node.value]
            for name in names:
                if name.split(".")[0] in FOLDER_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, "\n".join(found)


def test_the_cli_loads_no_module_under_a_bare_folder_name():
    """Run from the repository root, where the folders are importable by their bare names: loading every
    subcommand still imports each module once, as `kvmesh.*`."""
    code = (
        "import sys\n"
        "from kvmesh.deployments.cli import build_parser\n"
        "build_parser()\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {FOLDER_NAMES!r}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"

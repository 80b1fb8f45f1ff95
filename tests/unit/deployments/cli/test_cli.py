"""The `kvmesh` entry point: bad arguments give one line on stderr and exit 2, never a traceback; one CLI
package holds every subcommand and the argument checks they share, and library code never imports it."""

import argparse
import ast
import importlib
import re
import subprocess
import sys

import pytest
from paths import REPO_ROOT

from kvmesh.deployments.cli import args, main


def _run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.deployments.cli", *argv], capture_output=True, text=True, timeout=120
    )


def test_unknown_subcommand_is_one_line_exit_2():
    r = _run("frobnicate")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "frobnicate" in r.stderr


def test_no_subcommand_is_an_error():
    r = _run()
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_distributions_version(flag):
    from importlib.metadata import version

    r = _run(flag)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"kvmesh {version('kvmesh')}\n", "")


ROOT = REPO_ROOT
LIBRARY = ("cluster", "kvstore", "policies", "benchmarks", "deployments")


def _library_sources():
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / "deployments" / "cli") not in path.parents:
                yield path


def _python_m_targets(tree: ast.AST) -> set[ast.AST]:
    """String constants that follow "-m" in an argv list: `python -m kvmesh.deployments.cli serve` runs the CLI as
    a program in a child process (a supervisor, a benchmark acting as a user), which is not an import."""
    out: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            for prev, item in zip(node.elts, node.elts[1:]):
                if isinstance(prev, ast.Constant) and prev.value == "-m" and isinstance(item, ast.Constant):
                    out.add(item)
    return out


def test_library_code_never_imports_the_cli():
    """The CLI imports the library, never the other way round: library errors are the library's own."""
    found = []
    for path in _library_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        run_as_program = _python_m_targets(tree)
        for node in ast.walk(tree):
            if node in run_as_program:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            else:
                continue
            if any(n == "kvmesh.deployments.cli" or n.startswith("kvmesh.deployments.cli.") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_every_subcommand_lives_in_the_cli_package():
    from kvmesh.deployments import cli

    assert not [p for f in LIBRARY for p in (ROOT / f).rglob("*_cmd.py")]
    for name in cli.COMMANDS:
        mod = importlib.import_module(f"kvmesh.deployments.cli.{name}")
        assert callable(mod.add_arguments) and callable(mod.run), name


@pytest.mark.parametrize(
    "check, text, value",
    [
        (args.positive_int, "3", 3),
        (args.non_negative_int, "0", 0),
        (args.positive_float, "0.5", 0.5),
        (args.non_negative_float, "0", 0.0),
        (args.int_range, "2", (2, 2)),
        (args.int_range, "1-3", (1, 3)),
        (args.choices_csv(("a", "b")), "b, a", ("b", "a")),
        (args.int_up_to(10), "10", 10),
        (args.int_up_to(10, minimum=0), "0", 0),
        (args.float_up_to(1e12), "1e12", 1e12),
        (args.int_range_up_to(5), "1-5", (1, 5)),
    ],
)
def test_shared_argument_types_accept(check, text, value):
    assert check(text) == value


@pytest.mark.parametrize(
    "check, text, message",
    [
        (args.positive_int, "0", "must be >= 1, got 0"),
        (args.positive_int, "x", "expected a whole number, got 'x'"),
        (args.non_negative_int, "-1", "must be >= 0"),
        (args.positive_float, "inf", "must be a positive number"),
        (args.positive_float, "nan", "must be a positive number"),
        (args.non_negative_float, "-0.5", "must be >= 0"),
        (args.non_negative_float, "inf", "must be a finite number"),
        (args.non_negative_float, "nan", "must be a finite number"),
        (args.output_file, "/", "is a directory, not a file"),
        (args.output_file, "/proc/1/x/out.json", "cannot be written here"),
        (args.int_range, "3-1", "expected 1 <= MIN <= MAX"),
        (args.int_range, "1-", "expected N or MIN-MAX"),  # read as 1 before
        (args.choices_csv(("a", "b")), "c", "choose from a, b"),
        (args.choices_csv(("a", "b")), ",", "choose from a, b"),
        (args.int_up_to(10), "11", "must be <= 10, got 11"),
        (args.int_up_to(10), "0", "must be >= 1, got 0"),
        (args.int_up_to(args.INT64_MAX), "9" * 400, "must be <= 9,223,372,036,854,775,807, got 9999"),
        (args.float_up_to(1e12), "inf", "must be a finite number"),
        (args.float_up_to(1e12), "1e307", "must be <= 1e+12"),
        (args.int_range_up_to(5), "1-6", "MAX must be <= 5"),
    ],
)
def test_shared_argument_types_reject_with_one_message(check, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        check(text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["simulate", "--trace", "conversation", "--replicas", "0", "--capacity-blocks", "1"],
            "--replicas: must be >= 1",
        ),
        (["trace", "synth", "--out", "x.jsonl", "--turns", "x"], "--turns: expected a whole number"),
        (
            ["replay", "--url", "http://u", "--trace", "t", "--json", "j", "--timeout", "-1"],
            "--timeout: must be a positive number",
        ),
        (["demo", "--replicas", "0"], "--replicas: must be >= 1"),
    ],
)
def test_subcommands_share_the_checks(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("engine: 5", "engine must be a mapping"),
        ("proxy: []", "config.proxy must be one of"),
        ("engine: {model: 5}", "engine.model must be a non-empty string"),
        ("host: 5", "config.host must be a non-empty string"),
        ("port: 70000", "config.port must be an integer 0-65535"),
        ("engine: {num_cpus: abc}", "engine.num_cpus must be a number"),
        ("engine: {num_gpus: -1}", "engine.num_gpus must be a number >= 0"),
        ("engine: {lmcache: {l1_size_gbb: 4}}", "engine.lmcache: unknown lmcache key"),
        ("speculative_ttl_s: x", "config.speculative_ttl_s must be a number"),
        ("mismatch_alarm_after: x", "config.mismatch_alarm_after must be an integer"),
        ("address: 127.0.0.1", "config.address must be a Ray cluster's GCS address host:port"),
        ("{tenants_file: t.yaml, api_keys: [kvm-abcdefgh12345]}", "exclude each other"),
    ],
)
def test_a_serving_config_that_would_fail_later_is_refused_in_one_line(tmp_path, capsys, text, message):
    """Wrong types and values stop the config with one line and exit 2, before anything starts: not a
    traceback, and not replicas failing after deployment."""
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_api_key_on_the_command_line_replaces_a_tenants_file_from_the_config(tmp_path):
    """The key serve prints must be the one that works: a tenants file from the config would refuse it."""
    from kvmesh.deployments.cli import build_parser
    from kvmesh.deployments.cli.serve import _build_config

    config = tmp_path / "c.yaml"
    config.write_text("tenants_file: t.yaml\n")
    parsed = build_parser("serve").parse_args(["serve", "--config", str(config), "--api-key", "kvm-abcdefgh12345"])
    cfg = _build_config(parsed)
    assert cfg["api_keys"] == ["kvm-abcdefgh12345"] and cfg["tenants_file"] is None


def test_the_api_key_reaches_the_serve_driver_through_its_environment_not_its_command_line():
    from kvmesh.deployments.cli import build_parser
    from kvmesh.deployments.cli.serve import _flags

    parsed = build_parser("serve").parse_args(["serve", "--port", "8123", "--api-key", "kvm-supersecret123"])
    assert "kvm-supersecret123" not in _flags(parsed) and "--port" in _flags(parsed)


def test_the_demo_refuses_a_model_that_is_not_there_before_anything_starts(capsys):
    assert main(["demo", "--model", "/nonexistent-model-dir"]) == 2
    assert "not a local model directory" in capsys.readouterr().err

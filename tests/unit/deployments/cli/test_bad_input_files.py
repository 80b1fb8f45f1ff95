"""Bad input files and paths to the CLI: one line on stderr and exit status 2, never a traceback, a hang or a
lost file. Each case is a file or path a user can hand the command by mistake (an occupied folder, a trace
as its own output, a log nested past Python's parsers, a config with inline API keys)."""

from __future__ import annotations

import json

import pytest
import yaml
from cli_checks import refused
from paths import REPO_ROOT

from kvmesh.deployments.cli import CliError, build_parser, main

RECORD = {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [0, 1, 2]}


def _trace(tmp_path, records: int = 2):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(dict(RECORD, timestamp=i)) + "\n" for i in range(records)))
    return path


# ---------------------------------------------------------------------------- kvmesh model build-tiny
def test_build_tiny_refuses_a_folder_holding_other_files_and_deletes_nothing(tmp_path, capsys):
    target = tmp_path / "mine"
    (target / "sub").mkdir(parents=True)
    (target / "notes.txt").write_text("precious")
    err = refused(capsys, "model", "build-tiny", str(target))
    assert "not a tiny-model build" in err
    assert (target / "notes.txt").read_text() == "precious" and (target / "sub").is_dir()


def test_build_tiny_refuses_an_empty_path_which_is_the_current_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("precious")
    assert "empty path" in refused(capsys, "model", "build-tiny", "")
    assert (tmp_path / "notes.txt").read_text() == "precious"


# ---------------------------------------------------------------------------- kvmesh trace bounds
def test_trace_bounds_caps_replicas_as_simulate_does():
    from kvmesh.deployments.cli.simulate import MAX_SIM_REPLICAS

    parser = build_parser("trace")
    argv = ["trace", "bounds", "--trace", "conversation", "--replicas"]
    assert parser.parse_args([*argv, str(MAX_SIM_REPLICAS)]).replicas == MAX_SIM_REPLICAS
    with pytest.raises(CliError, match="--replicas: must be <= 100,000"):
        parser.parse_args([*argv, "100000000000"])


def test_trace_bounds_refuses_a_warmup_that_leaves_nothing_to_measure(tmp_path, capsys):
    trace = _trace(tmp_path, records=2)
    assert "--warmup 5 leaves no request to measure" in refused(
        capsys, "trace", "bounds", "--trace", str(trace), "--warmup", "5"
    )
    assert "--warmup 2" in refused(capsys, "trace", "bounds", "--trace", str(trace), "--warmup", "2")
    assert main(["trace", "bounds", "--trace", str(trace), "--warmup", "1"]) == 0
    assert capsys.readouterr().out.startswith("1 requests")


def test_trace_bounds_refuses_to_write_its_result_over_the_trace_it_reads(tmp_path, monkeypatch, capsys):
    trace = _trace(tmp_path)
    before = trace.read_text()
    assert "is the trace being read" in refused(capsys, "trace", "bounds", "--trace", str(trace), "--json", str(trace))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(trace)
    assert "is the trace being read" in refused(
        capsys, "trace", "bounds", "--trace", "link.jsonl", "--json", "./trace.jsonl"
    )
    assert trace.read_text() == before
    assert main(["trace", "bounds", "--trace", str(trace), "--json", str(tmp_path / "out.json")]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == 2


# ---------------------------------------------------------------------------- kvmesh demo
def test_demo_caps_replicas_as_simulate_does():
    parser = build_parser("demo")
    assert parser.parse_args(["demo", "--simulate", "--replicas", "100000"]).replicas == 100_000
    with pytest.raises(CliError, match="--replicas: must be <= 100,000"):
        parser.parse_args(["demo", "--simulate", "--replicas", "1000000"])


def test_a_live_demo_has_the_apps_replica_limit(capsys, monkeypatch):
    """Over it the app's config refused the run once it started, as a traceback."""
    from kvmesh.deployments.cli import demo

    monkeypatch.setattr(demo, "_run_live", lambda *a, **k: pytest.fail("the live run started"))
    err = refused(capsys, "demo", "--replicas", "20000", "--conversations", "1", "--policies", "round_robin")
    assert "--replicas must be <= 10,000 for a live run" in err


@pytest.mark.parametrize(
    "flags", [["--max-tokens", "5000"], ["--max-tokens", "2040"], ["--tokens-per-block", "4096"]], ids=str
)
def test_demo_refuses_a_workload_that_comes_out_empty(flags, capsys):
    err = refused(capsys, "demo", "--simulate", "--conversations", "2", "--policies", "kvmesh", *flags)
    assert "no conversation of the trace fits the 2048-token context" in err and flags[1] in err


# ---------------------------------------------------------------------------- kvmesh cachetest --requests
@pytest.mark.parametrize(
    "line, message",
    [
        ("[" * 100_000, "line 1: JSON nested too deeply"),
        ('{"body": {"prompt": "hi"}, "timestamp": ' + "1" * 5000 + "}", "line 1: a number too long to read"),
    ],
    ids=["nested", "long-integer"],
)
def test_cachetest_refuses_a_log_line_past_pythons_json_limits(tmp_path, capsys, line, message):
    log = tmp_path / "log.jsonl"
    log.write_text(line + "\n")
    err = refused(capsys, "cachetest", "--url", "http://127.0.0.1:9", "--requests", str(log), "--out", str(tmp_path))
    assert message in err


# ---------------------------------------------------------------------------- kvmesh k8s render
@pytest.fixture
def k8s_files(tmp_path):
    """(config path, manifest path): the repository's own pair, in a scratch folder."""
    config = tmp_path / "kvmesh.yaml"
    manifest = tmp_path / "rayservice.yaml"
    config.write_text((REPO_ROOT / "k8s" / "config" / "kvmesh.yaml").read_text())
    manifest.write_text((REPO_ROOT / "k8s" / "rayservice.yaml").read_text())
    return config, manifest


def render_refused(k8s_files, capsys) -> str:
    config, manifest = k8s_files
    before = manifest.read_text()
    err = refused(capsys, "k8s", "render", "--config", str(config), "--manifest", str(manifest))
    assert manifest.read_text() == before
    return err


def test_k8s_render_refuses_yaml_nested_past_the_reader(k8s_files, capsys):
    k8s_files[0].write_text("x: " + "[" * 1000 + "]" * 1000 + "\n")
    assert "YAML nested too deeply to read" in render_refused(k8s_files, capsys)


def test_k8s_render_refuses_values_nested_past_the_yaml_writer(k8s_files, capsys):
    """Read, but too deep for the checks and the writer that render the Serve config."""
    text = yaml.safe_dump(yaml.safe_load(k8s_files[0].read_text()))
    deep = "[" * 450 + "]" * 450
    extra = f"{{kv_connector: LMCacheConnectorV1, kv_role: kv_both, kv_connector_extra_config: {{x: {deep}}}}}"
    k8s_files[0].write_text(text.replace("engine:\n", f"engine:\n  kv_transfer_config: {extra}\n", 1))
    assert "nested too deeply" in render_refused(k8s_files, capsys)


def test_k8s_render_refuses_inline_api_keys_and_names_the_tenants_file(k8s_files, capsys):
    raw = yaml.safe_load(k8s_files[0].read_text())
    raw.pop("tenants_file")
    raw["api_keys"] = ["abcdefgh1234"]
    k8s_files[0].write_text(yaml.safe_dump(raw))
    err = render_refused(k8s_files, capsys)
    assert "config.api_keys" in err and "tenants_file" in err and "abcdefgh1234" not in err


@pytest.mark.parametrize(
    "param, message",
    [('num-cpus: "1e999"', "OverflowError"), ('resources: \'{"X": ' + "9" * 4000 + "}'", "OverflowError")],
    ids=["infinite-cpus", "huge-resource"],
)
def test_k8s_render_refuses_pod_sizes_no_number_holds(k8s_files, capsys, param, message):
    manifest = k8s_files[1]
    text = manifest.read_text()
    anchor = '          metrics-export-port: "8080"\n'
    assert anchor in text
    manifest.write_text(text.replace(anchor, anchor + f"          {param}\n", 1))
    assert message in render_refused(k8s_files, capsys)

"""Bad input to `kvmesh serve` and `kvmesh simulate` stops before the work, as one line and exit 2: a config
nested too deeply, NaN or infinite policy parameters, loads and cost constants whose times overflow or lose
their milliseconds, output paths that are folders, tenants files the ingress would refuse, and messages that
name the file or key at fault. Nothing here starts Ray: the serve launch is a stub that records it was reached."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from cli_checks import refused_naming as refused
from cli_checks import serve_launches

from kvmesh.deployments.cli import main
from kvmesh.deployments.config import ConfigError, app_config

KEY = "kvm-operator-supplied-key-0123456789"


@pytest.fixture
def launch(monkeypatch):
    """`kvmesh serve` up to its launch: the list of launches reached (none when the input is refused)."""
    return serve_launches(monkeypatch)


def serve_config(tmp_path, text: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return ["serve", "--port", "0", "--config", str(path)]


# ---------------------------------------------------------------------------------------------- serve


def test_a_config_nested_a_thousand_levels_deep_is_a_config_error(tmp_path, capsys, launch):
    """PyYAML parses nesting by recursion: 1,000 levels of `[` (2 KB) were a RecursionError traceback."""
    argv = serve_config(tmp_path, "x: " + "[" * 1000 + "]" * 1000 + "\n")
    refused(argv, capsys, "c.yaml is not valid YAML: nested too deeply")
    assert launch == []


@pytest.mark.parametrize(
    "params, needle",
    [
        ("{balance_slack: .nan}", "kvmesh: balance_slack must be a finite number >= 0, got nan"),
        ("{recompute_weight: .inf}", "kvmesh: recompute_weight must be a finite number"),
        ("{overshoot_cap: .nan}", "kvmesh: overshoot_cap must be a finite number >= 1"),
        ("{guard_weight: 1.0e+308}", "kvmesh: guard_weight must be a finite number >= 0 and <= 1e+06"),
        ("{hold_for_tier: 'false'}", "kvmesh: hold_for_tier must be true or false"),
        ("{cost: 5}", "kvmesh: cost must be a mapping of cost model constants (prefill_s_per_token"),
        (
            "{cost: {prefill_s_per_token: 1.0e+308}}",
            "cost model: prefill_s_per_token must be a finite number >= 0 and <= 1, got 1e+308",
        ),
    ],
)
def test_policy_params_that_mean_nothing_stop_the_config_naming_the_key(params, needle, tmp_path, capsys, launch):
    """NaN passed the `x < 0` range checks (simulated: hit rate 0.084 -> 0.047), and `cost: 5` was reported as
    "'int' object is not iterable"."""
    refused(serve_config(tmp_path, f"policy_params: {params}\n"), capsys, f"config.policy_params: {needle}")
    assert launch == []
    with pytest.raises(ConfigError, match="config.policy_params"):  # what `kvmesh k8s render` checks with
        app_config(yaml.safe_load(f"policy_params: {params}\n"))


@pytest.mark.parametrize(
    "text, needle",
    [
        ("route_prefix: no-slash\n", "config.route_prefix must start with '/', not end with one"),
        ("route_prefix: /v1/\n", "got '/v1/'"),
        ("replicas: 100000000000\n", "config.replicas must be at most 10000, got 100000000000"),
        ("ingress_replicas: 100000000000\n", "config.ingress_replicas must be at most 10000"),
        ("api_keys: ['']\n", "config.api_keys[0]: API key must be 8-256 characters"),
        (
            "replicas: 4\nautoscaling: {min_replicas: 1, max_replicas: 2}\n",
            "config.replicas (4) and config.autoscaling exclude each other",
        ),
        ("autoscaling: {policy: {1: 2}}\n", "config.autoscaling.policy: keys must be names (strings), got 1"),
        ("engine: {enforce_eager: maybe}\n", "engine.enforce_eager must be true, false or null, got 'maybe'"),
        ("engine: {dtype: float33}\n", "engine.dtype must be one of auto, half"),
        ("engine: {kv_transfer_config: LMCacheConnectorV1}\n", "engine.kv_transfer_config must be a mapping"),
        ("address: head:99999\n", "config.address must be a Ray cluster's GCS address host:port"),
        ("address: ray://head:10001\n", "config.address: 'ray://head:10001' is a Ray Client address"),
    ],
)
def test_config_values_serve_would_refuse_only_once_ray_runs_stop_here(text, needle, tmp_path, capsys, launch):
    """Each reached the launch (exit 0 with the launch stubbed); an empty key was reported as --api-key's."""
    refused(serve_config(tmp_path, text), capsys, needle)
    assert launch == []


@pytest.mark.parametrize("prefix", ["/", "/v1", "/a/b", "v1", "", "/v1/", "//", "/a{b}", "/}", "/a b", "/%7B"])
def test_the_route_prefix_rule_is_serves(prefix):
    """config.py restates Serve's private `validate_route_prefix` (it has no public form): the two agree."""
    utils = pytest.importorskip("ray.serve._private.utils")
    try:
        utils.validate_route_prefix(prefix)
        serve_ok = True
    except ValueError:
        serve_ok = False
    try:
        app_config({"route_prefix": prefix})
        ours_ok = True
    except ConfigError:
        ours_ok = False
    assert ours_ok == serve_ok, prefix


def test_replicas_on_the_command_line_have_the_autoscaling_cap(capsys, launch):
    refused(["serve", "--port", "0", "--replicas", "100000000000"], capsys, "config.replicas must be at most 10000")
    assert launch == []


@pytest.mark.parametrize("kind", ["missing", "binary", "folder", "malformed"])
def test_a_tenants_file_the_ingress_would_refuse_stops_the_cli(kind, tmp_path, capsys, launch):
    """The ingress replica loads the tenants file only once Ray runs: a bad one reached the launch."""
    path = tmp_path / "tenants.yaml"
    if kind == "binary":
        path.write_bytes(bytes(range(128, 256)))
    elif kind == "folder":
        path.mkdir()
    elif kind == "malformed":
        path.write_text("tenants: []\n")
    needle = {
        "missing": "--tenants: cannot read tenants file",
        "binary": f"--tenants: cannot read tenants file {path}: not UTF-8 text (byte 0)",
        "folder": "Is a directory",
        "malformed": f"--tenants: tenants file {path}: tenants: expected a non-empty list",  # the file and key
    }[kind]
    refused(["serve", "--port", "0", "--tenants", str(path)], capsys, needle)
    assert launch == []


def test_a_good_tenants_file_reaches_the_launch(tmp_path, launch):
    from kvmesh.deployments.tenants import hash_api_key

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"id": "acme", "keys": [{"sha256": hash_api_key(KEY)}]}]}))
    assert main(["serve", "--port", "0", "--tenants", str(path)]) == 0
    assert launch and "--tenants" in launch[0]


def test_a_tenants_file_from_the_config_is_checked_too(tmp_path, capsys, launch):
    argv = serve_config(tmp_path, f"tenants_file: {tmp_path / 'nope.yaml'}\n")
    refused(argv, capsys, "config.tenants_file: cannot read tenants file")
    assert launch == []


@pytest.mark.parametrize("flag", ["--api-key", "--api-key-file"])
def test_an_api_key_beside_a_tenants_file_is_refused_not_dropped(flag, tmp_path, capsys, launch):
    """The key was dropped without a word: the server ran on the tenants file's keys alone."""
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    value = KEY if flag == "--api-key" else str(key_file)
    argv = ["serve", "--port", "0", "--tenants", str(tmp_path / "t.yaml"), flag, value]
    refused(argv, capsys, "--tenants and --api-key/--api-key-file exclude each other")
    assert launch == []


@pytest.mark.parametrize("kind", ["binary", "folder", "missing"])
def test_an_unreadable_api_key_file_is_named(kind, tmp_path, capsys, launch):
    """A binary file was reported as "'utf-8' codec can't decode byte ...", naming neither flag nor file."""
    path = tmp_path / "key"
    if kind == "binary":
        path.write_bytes(b"\xff\xfe" + bytes(64))
    elif kind == "folder":
        path.mkdir()
    refused(["serve", "--port", "0", "--api-key-file", str(path)], capsys, f"--api-key-file {path}: ")
    assert launch == []


# ---------------------------------------------------------------------------------------------- simulate

SIM = ["simulate", "--trace", "conversation", "--replicas", "4", "--capacity-blocks", "1000", "--limit", "40"]
SIM_END = ["--policies", "round_robin", "--no-progress"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--load", "1e-15"], "--load: must be >= 0.001, got 1e-15"),  # p50 TTFT 0.000
        (["--load", "1e-308"], "--load: must be >= 0.001"),  # TTFT nan
        (["--load", "1e9"], "--load: must be <= 1000"),
        (["--uncached-rate", "1e308"], "--uncached-rate: must be <= 1e+06"),  # cost inf
        (["--cached-rate", "1e308"], "--cached-rate: must be <= 1e+06"),
        (
            ["--cost-model", '{"prefill_s_per_token": 1e308}'],
            "prefill_s_per_token must be a finite number >= 0 and <= 1,",
        ),  # TTFT inf
        (["--cost-model", '{"max_batch": 100000000000}'], "max_batch must be a whole number >= 1 and <= 1e+06"),
    ],
)
def test_values_that_made_times_or_costs_overflow_are_refused(extra, needle, capsys):
    refused(SIM + extra + SIM_END, capsys, needle)


def _no_simulation(monkeypatch):
    from kvmesh.cluster import simulator

    def simulate(*a, **kw):
        raise AssertionError("the simulation ran before its output path was checked")

    monkeypatch.setattr(simulator, "simulate", simulate)


@pytest.mark.parametrize("flag, name", [("--plot", "out.png"), ("--json", "out.json")])
def test_an_output_path_that_is_a_folder_stops_before_the_simulation(flag, name, tmp_path, capsys, monkeypatch):
    """`--plot DIR` ran the whole simulation, then failed with "Is a directory"."""
    _no_simulation(monkeypatch)
    (tmp_path / name).mkdir()
    refused(SIM + [flag, str(tmp_path / name)] + SIM_END, capsys, "is a directory, not a file")


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: None, "No such file or directory (give a JSON object, or a JSON file)"),
        (lambda p: p.mkdir(), "Is a directory"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00"), "not UTF-8 text (byte 0)"),
        (lambda p: p.write_text("prefill_s_per_token: 1\n"), "not valid JSON (Expecting value"),
    ],
)
def test_a_cost_model_file_that_cannot_be_read_is_named(make, needle, tmp_path, capsys, monkeypatch):
    """A missing file or a folder was tried as inline JSON: "--cost-model: Expecting value: line 1 column 1"."""
    _no_simulation(monkeypatch)
    path = tmp_path / "cost.json"
    make(path)
    refused(SIM + ["--cost-model", str(path)] + SIM_END, capsys, f"--cost-model {path}: {needle}")


def test_the_json_document_never_holds_nan_or_infinity(tmp_path, capsys, monkeypatch):
    """`--load 1e-308` wrote `NaN` into the --json document, which JSON readers refuse: a non-finite result is
    now an error, and the file is not written."""
    from kvmesh.cluster import simulator

    real = simulator.simulate

    def with_nan(*a, **kw):
        doc = real(*a, **kw)
        doc["policies"]["round_robin"]["ttft_p50_s"] = math.nan
        return doc

    monkeypatch.setattr(simulator, "simulate", with_nan)
    out = tmp_path / "out.json"
    assert main(SIM + ["--json", str(out)] + SIM_END) == 2
    assert "holds NaN or an infinity" in capsys.readouterr().err
    if out.exists():  # never a document with a NaN in it
        json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

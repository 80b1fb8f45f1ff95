"""A config that cannot start the app stops as a ConfigError with one line, whatever is wrong in it: keys
that are not names (YAML reads `1: 2` as an int key), autoscaling where Ray Serve is not installed, and
autoscaling values Serve refuses or would take although they are not numbers of their kind."""

from __future__ import annotations

import sys

import pytest

from kvmesh.deployments.config import ConfigError, app_config, load_config


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({1: 2}, "config"),
        ({"replicas": 2, 1: 2}, "config"),
        ({"engine": {1: 2}}, "engine"),
        ({"autoscaling": {1: 2}}, "config.autoscaling"),
    ],
)
def test_a_key_that_is_not_a_name_is_a_one_line_config_error(raw, where):
    with pytest.raises(ConfigError) as info:
        app_config(raw)
    message = str(info.value)
    assert message.startswith(f"{where}: keys must be names") and "1" in message
    assert len(message.splitlines()) == 1


def test_a_yaml_file_with_an_int_key_is_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("replicas: 2\n1: 2\n")
    with pytest.raises(ConfigError, match=r"^config: keys must be names \(strings\), got 1$"):
        load_config(path)


def test_autoscaling_without_ray_serve_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.serve.config", None)  # what an install without Ray raises
    with pytest.raises(ConfigError) as info:
        app_config({"autoscaling": {"min_replicas": 1, "max_replicas": 2}})
    assert str(info.value) == "config.autoscaling needs Ray Serve to check it: install ray[serve]"
    assert app_config({})["autoscaling"] is None  # a config without autoscaling needs no Ray


def test_kvmesh_serve_names_a_bad_key_on_one_line_and_exits_2(tmp_path, capsys):
    from kvmesh.deployments.cli import main

    (tmp_path / "c.yaml").write_text("autoscaling: {1: 2}\n")
    assert main(["serve", "--config", str(tmp_path / "c.yaml")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == ["error: config.autoscaling: keys must be names (strings), got 1"]


@pytest.mark.parametrize(
    ("autoscaling", "line"),
    [
        (
            {"min_replicas": 3, "max_replicas": 1},
            "config.autoscaling: max_replicas (1) must be greater than or equal to min_replicas (3)",
        ),
        (
            {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5},
            "config.autoscaling: max_replicas (2) must be greater than or equal to initial_replicas (5)",
        ),
        (
            {"min_replicas": 1, "max_replicas": 3, "policy": 5},
            "config.autoscaling.policy: Input should be a valid dictionary or instance of AutoscalingPolicy, got 5",
        ),
        (
            {"aggregation_function": "median"},
            "config.autoscaling.aggregation_function: 'median' is not a valid AggregationFunction",
        ),
        (
            {"policy": {"policy_function": "no_such_module:policy"}},
            "config.autoscaling.policy: cannot load its policy_function (No module named 'no_such_module')",
        ),
    ],
)
def test_a_refused_autoscaling_config_names_the_key_and_the_reason(autoscaling, line):
    """Pydantic's own first line says only how many errors there were: the key and the reason are kept."""
    with pytest.raises(ConfigError) as info:
        app_config({"autoscaling": autoscaling})
    assert str(info.value) == line


@pytest.mark.parametrize(
    ("yaml_value", "line"),
    [
        ("{min_replicas: '2', max_replicas: 3}", "config.autoscaling.min_replicas must be an integer >= 0, got '2'"),
        ("{min_replicas: true, max_replicas: 3}", "config.autoscaling.min_replicas must be an integer >= 0, got True"),
        ("{min_replicas: 1.0, max_replicas: 3}", "config.autoscaling.min_replicas must be an integer >= 0, got 1.0"),
        ("{max_replicas: 0}", "config.autoscaling.max_replicas must be an integer >= 1, got 0"),
        ("{initial_replicas: -1}", "config.autoscaling.initial_replicas must be an integer >= 0, got -1"),
        (
            "{max_replicas: 1000000000000000000000000000000}",
            "config.autoscaling.max_replicas must be at most 10000, got 1000000000000000000000000000000",
        ),
        ("{target_ongoing_requests: .inf}", "config.autoscaling.target_ongoing_requests must be a number > 0, got inf"),
        ("{target_ongoing_requests: 0}", "config.autoscaling.target_ongoing_requests must be a number > 0, got 0"),
        ("{upscale_delay_s: yes}", "config.autoscaling.upscale_delay_s must be a number >= 0, got True"),
        ("{downscale_delay_s: '600'}", "config.autoscaling.downscale_delay_s must be a number >= 0, got '600'"),
    ],
)
def test_autoscaling_numbers_are_numbers_of_their_kind(tmp_path, yaml_value, line):
    """Serve's model is lax: it reads "2", true and 1.0 as replica counts and .inf as a target."""
    path = tmp_path / "c.yaml"
    path.write_text(f"autoscaling: {yaml_value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == line


def test_an_integer_too_large_for_a_float_is_a_config_error_not_a_crash():
    with pytest.raises(ConfigError, match=r"^config\.autoscaling\.upscale_delay_s must be a number >= 0, got 1000"):
        app_config({"autoscaling": {"upscale_delay_s": 10**400}})
    with pytest.raises(ConfigError, match=r"^engine\.num_cpus must be a number"):
        app_config({"engine": {"num_cpus": 10**400}})


def test_good_autoscaling_numbers_pass_as_given():
    auto = {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 2}
    auto |= {"upscale_delay_s": 0, "downscale_delay_s": 1.5, "metrics_interval_s": 0.5, "upscaling_factor": None}
    assert app_config({"autoscaling": auto})["autoscaling"] == auto


def test_kvmesh_serve_names_the_autoscaling_flag_against_the_configs_initial_replicas(tmp_path, capsys):
    from kvmesh.deployments.cli import main

    (tmp_path / "c.yaml").write_text("autoscaling: {min_replicas: 1, max_replicas: 8, initial_replicas: 5}\n")
    assert main(["serve", "--config", str(tmp_path / "c.yaml"), "--autoscaling", "1:2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == [
        "error: config.autoscaling: max_replicas (2) must be greater than or equal to initial_replicas (5)"
    ]

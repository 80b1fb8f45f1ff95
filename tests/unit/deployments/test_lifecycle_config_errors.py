"""A config that cannot start the app stops as a ConfigError with one line, whatever is wrong in it: keys
that are not names (YAML reads `1: 2` as an int key), and autoscaling where Ray Serve is not installed."""

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

"""`kvmesh serve` argument handling without starting anything: one-line errors with exit 2, flags over
the config file."""

from __future__ import annotations

import pytest

from kvmesh.deployments import openai_protocol as proto


# ---------------------------------------------------------------------------- request validation
def err(fn, body) -> proto.OpenAIError:
    with pytest.raises(proto.OpenAIError) as info:
        fn(body)
    return info.value


# ---------------------------------------------------------------------------- config


def test_serve_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    from kvmesh.deployments.cli import main

    assert main(["serve", "--policy", "nope"]) == 2
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad.yaml").write_text("engine: {block_size: 33}\n")
    assert main(["serve", "--config", str(tmp_path / "bad.yaml")]) == 2
    # a misspelt policy parameter stops the config before anything starts
    (tmp_path / "typo.yaml").write_text("policy_params: {guard_wieght: 45}\n")
    assert main(["serve", "--config", str(tmp_path / "typo.yaml")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 4 and all(line.startswith("error: ") for line in lines)
    assert "guard_wieght" in lines[-1] and "guard_weight" in lines[-1]


def test_a_tool_call_parser_is_one_of_vllms_and_reaches_the_config(tmp_path, capsys):
    import argparse

    from kvmesh.deployments.cli import main
    from kvmesh.deployments.cli import serve as serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    cfg = serve_cmd._build_config(parser.parse_args(["--tool-call-parser", "hermes"]))
    assert cfg["tool_call_parser"] == "hermes"
    assert serve_cmd._build_config(parser.parse_args([]))["tool_call_parser"] is None
    (tmp_path / "c.yaml").write_text("tool_call_parser: hermess\n")
    assert main(["serve", "--tool-call-parser", "hermess"]) == 2
    assert main(["serve", "--config", str(tmp_path / "c.yaml")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 2 and all("'hermess' is not one of vLLM's" in line and "hermes," in line for line in lines)


# ---------------------------------------------------------------------------- router with fake replicas


def test_serve_flags_override_the_config_file(tmp_path):
    import argparse

    from kvmesh.deployments.cli import serve as serve_cmd

    p = tmp_path / "c.yaml"
    p.write_text("replicas: 4\npolicy: round_robin\nport: 9000\nengine: {block_size: 64}\n")
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    cfg = serve_cmd._build_config(
        parser.parse_args(
            ["--config", str(p), "--replicas", "2", "--api-key", "kvm-abcdefgh12345", "--block-size", "32"]
        )
    )
    assert (cfg["replicas"], cfg["policy"], cfg["port"]) == (2, "round_robin", 9000)
    assert cfg["engine"]["block_size"] == 32 and cfg["api_keys"] == ["kvm-abcdefgh12345"]
    assert cfg["proxy"] == "haproxy"
    assert serve_cmd._build_config(parser.parse_args(["--config", str(p), "--proxy", "serve"]))["proxy"] == "serve"
    generated = serve_cmd._build_config(parser.parse_args([]))["api_keys"]
    assert len(generated) == 1 and generated[0].startswith("kvm-") and len(generated[0]) > 20


def test_serve_address_and_autoscaling_flags_reach_the_config(tmp_path, capsys):
    import argparse

    from kvmesh.deployments.cli import main
    from kvmesh.deployments.cli import serve as serve_cmd
    from kvmesh.deployments.config import ConfigError, app_config
    from kvmesh.deployments.deploy_plan import actor_resources, engine_options

    p = tmp_path / "c.yaml"
    p.write_text(
        "address: 127.0.0.1:6379\nautoscaling: {target_ongoing_requests: 1, upscale_delay_s: 1}\n"
        "engine: {resources: {kvmesh_engine: 1}}\n"
    )
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    cfg = serve_cmd._build_config(parser.parse_args(["--config", str(p), "--autoscaling", "1:3"]))
    assert cfg["address"] == "127.0.0.1:6379"
    assert cfg["autoscaling"] == {
        "target_ongoing_requests": 1,
        "upscale_delay_s": 1,
        "min_replicas": 1,
        "max_replicas": 3,
    }
    over = serve_cmd._build_config(parser.parse_args(["--config", str(p), "--address", "10.0.0.1:6380"]))
    assert over["address"] == "10.0.0.1:6380"
    opts = engine_options(cfg, {})
    assert opts["num_replicas"] == "auto" and opts["autoscaling_config"]["max_replicas"] == 3
    assert opts["ray_actor_options"]["resources"] == {"kvmesh_engine": 1}
    assert actor_resources(cfg)["EngineReplica"]["kvmesh_engine"] == 1.0
    # the driver process gets the same flags back
    assert "1:3" in serve_cmd._flags(parser.parse_args(["--autoscaling", "1:3"]))
    for bad in ("3:1", "2", "a:b", "0:0"):
        assert main(["serve", "--autoscaling", bad]) == 2
    for bad_cfg in ({"address": ""}, {"engine": {"resources": {"CPU": 1}}}, {"engine": {"resources": {"x": 0}}}):
        with pytest.raises(ConfigError):
            app_config(bad_cfg)
    assert all(line.startswith("error: ") for line in capsys.readouterr().err.splitlines() if line)


def test_the_start_banner_gives_the_autoscaling_range(monkeypatch, capsys):
    """Under autoscaling `replicas` (2 by default) is not what runs: the banner names the range."""
    import argparse

    from kvmesh.deployments import app, process_tree
    from kvmesh.deployments.cli import CliError
    from kvmesh.deployments.cli import serve as serve_cmd
    from kvmesh.deployments.config import app_config

    def no_start(cfg, **kwargs):
        raise RuntimeError("not started in a unit test")

    monkeypatch.setattr(app, "start_local", no_start)
    monkeypatch.setattr(app, "stop_local", lambda drain=True: None)
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: None)
    args = argparse.Namespace(num_cpus=None, address=None)
    banners = []
    ranges = ({"min_replicas": 1, "max_replicas": 8}, {"min_replicas": 2, "max_replicas": 6, "initial_replicas": 3})
    for auto in (None, *ranges):
        with pytest.raises(CliError, match="not started in a unit test"):
            serve_cmd._drive(args, app_config({"autoscaling": auto}))
        banners.append(capsys.readouterr().err.splitlines()[0])
    assert banners == [
        "starting kvmesh: 2 engine replica(s), policy kvmesh, model tiny ...",
        "starting kvmesh: 1-8 engine replicas (autoscaling, 1 at start), policy kvmesh, model tiny ...",
        "starting kvmesh: 2-6 engine replicas (autoscaling, 3 at start), policy kvmesh, model tiny ...",
    ]


def test_a_failed_start_is_one_plain_line_without_rays_colour_codes(monkeypatch):
    """Ray colours the task name in its errors (`ray::ProxyActor.ready()`): the escape codes reached the one
    line `kvmesh serve` prints as raw bytes."""
    import argparse

    from kvmesh.deployments import app, process_tree
    from kvmesh.deployments.cli import CliError
    from kvmesh.deployments.cli import serve as serve_cmd
    from kvmesh.deployments.config import app_config

    def colour_failure(cfg, **kwargs):
        raise RuntimeError(
            "\x1b[36mray::ProxyActor.ready()\x1b[39m (pid=2719, ip=127.0.0.1)\n  File x, line 1\nOSError: in use"
        )

    monkeypatch.setattr(app, "start_local", colour_failure)
    monkeypatch.setattr(app, "stop_local", lambda drain=True: None)
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: None)
    with pytest.raises(CliError) as info:
        serve_cmd._drive(argparse.Namespace(num_cpus=None, address=None), app_config({}))
    assert str(info.value) == "could not start the app: ray::ProxyActor.ready() (pid=2719, ip=127.0.0.1)"


def test_the_start_banner_resolves_autoscaling_as_serve_does(monkeypatch, capsys):
    """Keys the autoscaling mapping leaves out take Serve's defaults for autoscaling deployments (max_replicas
    100): `{min_replicas: 2}` crashed the banner (a plain AutoscalingConfig has max_replicas 1) with a
    traceback, and `{min_replicas: 1}` printed 1-1 while Serve ran up to 100."""
    import argparse

    from kvmesh.deployments import app, process_tree
    from kvmesh.deployments.cli import CliError
    from kvmesh.deployments.cli import serve as serve_cmd
    from kvmesh.deployments.config import app_config

    texts = [
        serve_cmd.engine_replicas_text(app_config({"autoscaling": auto}))
        for auto in ({"min_replicas": 2}, {"min_replicas": 1}, {"initial_replicas": 3})
    ]
    assert texts == [
        "2-100 engine replicas (autoscaling, 2 at start)",
        "1-100 engine replicas (autoscaling, 1 at start)",
        "1-100 engine replicas (autoscaling, 3 at start)",
    ]

    # whatever else the banner trips on is a one-line start failure, not a traceback
    def broken(cfg):
        raise ValueError("cannot describe\nsecond line")

    started = []
    monkeypatch.setattr(serve_cmd, "engine_replicas_text", broken)
    monkeypatch.setattr(app, "start_local", lambda cfg, **kwargs: started.append(cfg))
    monkeypatch.setattr(app, "stop_local", lambda drain=True: None)
    monkeypatch.setattr(process_tree, "become_subreaper", lambda: None)
    with pytest.raises(CliError) as info:
        serve_cmd._drive(argparse.Namespace(num_cpus=None, address=None), app_config({}))
    assert str(info.value) == "could not start the app: cannot describe" and not started


def test_the_salt_secret_line_says_where_the_replicas_secret_comes_from(monkeypatch, tmp_path):
    """On a joined cluster handed no secret file the line read 'salt secret: None (kept across restarts)'."""
    from kvmesh.deployments.cli.serve import salt_secret_line

    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    assert salt_secret_line(str(tmp_path / "salt-secret")).endswith("(kept across restarts; see docs/tenants.md)")
    assert salt_secret_line("/etc/kvmesh/salt") == "salt secret: /etc/kvmesh/salt"
    joined = salt_secret_line(None)
    assert "None" not in joined and "nodes' own" in joined


def test_the_autoscaling_flag_takes_over_from_a_config_files_fixed_replicas(tmp_path):
    """`--autoscaling MIN:MAX` over a config file with `replicas: 4` was refused as a config setting both, though
    the flag, like --replicas, overrides the file."""
    import argparse

    from kvmesh.deployments.cli import serve as serve_cmd
    from kvmesh.deployments.config import app_config

    p = tmp_path / "c.yaml"
    p.write_text("replicas: 4\n")
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    cfg = app_config(serve_cmd._build_config(parser.parse_args(["--config", str(p), "--autoscaling", "1:3"])))
    assert cfg["autoscaling"]["max_replicas"] == 3

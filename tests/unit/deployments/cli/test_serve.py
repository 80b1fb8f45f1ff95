"""Fast tests of the live-serving parts without engines: request validation, config, the prediction
ledger, metrics text, the tiny model build, and the router's ranking/bookkeeping with fake replicas."""

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
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)


# ---------------------------------------------------------------------------- prediction ledger


# ---------------------------------------------------------------------------- metrics


# ---------------------------------------------------------------------------- tiny model


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

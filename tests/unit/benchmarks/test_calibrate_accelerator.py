"""The accelerator calibration on a CPU with a small shape: the same code path an H200 run takes, its
KV arithmetic, its output as a cost model, and its CLI errors."""

from __future__ import annotations

import json

import pytest

from kvmesh.benchmarks import calibrate_accelerator as ca
from kvmesh.policies.cost_model import CostModel


def test_kv_bytes_per_token_is_llama_8b_s_published_figure():
    # 32 layers x (K and V) x 8 KV heads x 128 dims x 2 bytes (bf16) = 128 KiB, the figure the cost model's
    # host-load default is derived from
    assert ca.SHAPES["llama-8b"].head_dim == 128
    assert ca.SHAPES["llama-8b"].kv_bytes_per_token() == 131072


def test_the_prefill_fit_recovers_a_quadratic_and_keeps_constants_non_negative():
    lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    times = [0.002 + 25e-6 * n + 1e-9 * n * n / 2 for n in lengths]
    base, per_token, pair = ca.fit_prefill(lengths, times)
    assert base == pytest.approx(0.002, rel=1e-6)
    assert per_token == pytest.approx(25e-6, rel=1e-6)
    assert pair == pytest.approx(1e-9, rel=1e-6)
    # two lengths: a line, no attention term
    base, per_token, pair = ca.fit_prefill([512, 1024], [0.015, 0.028])
    assert (base, pair) == (pytest.approx(0.002), 0.0) and per_token == pytest.approx(13 / 512 * 1e-3)
    # a line that crosses 0 above n = 0 fits a negative base: the base is set to 0 and the rest refitted,
    # never left negative
    lengths = [512, 1024, 2048, 4096]
    base, per_token, pair = ca.fit_prefill(lengths, [-0.001 + 3e-5 * n for n in lengths])
    assert base == 0.0 and per_token > 0.0 and pair >= 0.0


def test_a_model_config_gives_the_shape_it_names(tiny_model_dir, tmp_path):
    shape = ca.shape_from_hf_config(str(tiny_model_dir))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab) == (
        2,
        128,
        4,
        2,
        256,
        1024,
    )
    assert shape.head_dim == 32
    # a config naming a head size other than hidden / heads keeps it
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "head_dim": 64}))
    assert ca.shape_from_hf_config(str(tmp_path)).head_dim == 64
    assert ca.shape_from_hf_config(str(tmp_path)).kv_bytes_per_token() == 2 * 2 * 2 * 64 * 2
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="not a decoder config"):
        ca.shape_from_hf_config(str(tmp_path))


def test_a_cpu_run_gives_a_cost_model_the_simulator_accepts():
    result = ca.calibrate(
        "small", "cpu", lengths=(8, 16, 32), batch=2, context=16, load_tokens=32, rounds=1, suffix=4, prefixes=(0, 8)
    )
    cost = result["cost_model"]
    CostModel.from_dict(cost)  # refuses unknown keys and negative values
    assert set(cost) == {
        "prefill_s_per_token",
        "prefill_base_s",
        "attention_s_per_token_pair",
        "decode_s_per_token",
        "host_load_s_per_token",
    }
    m = result["measured"]
    assert list(m["prefill_s_by_length"]) == ["8", "16", "32"]
    assert all(t > 0 for t in m["prefill_s_by_length"].values())
    assert cost["decode_s_per_token"] > 0 and cost["host_load_s_per_token"] > 0
    assert m["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2
    assert list(m["suffix_prefill_s_by_cached_prefix"]) == ["0", "8"]
    assert result["defaults"] == CostModel().to_dict()


def test_prefill_attends_across_the_prompt_and_reads_a_cached_prefix():
    import torch

    model = ca._Model(torch, ca.SHAPES["small"], "cpu", torch.float32)
    x = torch.randn(1, 6, model.s.hidden)
    changed = x.clone()
    changed[:, 0] += 1.0
    with torch.inference_mode():
        logits = model.forward(x)
        assert logits.shape == (1, model.s.vocab)
        # the last token's logits depend on the first token: the layers attend over the prompt
        assert not torch.allclose(logits, model.forward(changed))
        caches = [
            (
                torch.randn(1, model.s.kv_heads, 4, model.s.head_dim),
                torch.randn(1, model.s.kv_heads, 4, model.s.head_dim),
            )
            for _ in range(model.s.layers)
        ]
        other = [(k + 1.0, v + 1.0) for k, v in caches]
        one = x[:, :1]
        assert not torch.allclose(model.forward(one, caches), model.forward(one, other))
        # several new tokens behind a cached prefix read it too
        assert model.forward(x, caches).shape == (1, model.s.vocab)
        assert not torch.allclose(model.forward(x, caches), model.forward(x, other))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lengths", "512"], "--lengths takes two or more distinct positive integers"),
        (["--lengths", "512,x"], "--lengths takes two or more distinct positive integers"),
        (["--lengths", "512,512"], "--lengths takes two or more distinct positive integers"),
        (["--rounds", "0"], "--rounds, --batch and --context must be >= 1"),
        (["--batch", "0"], "--rounds, --batch and --context must be >= 1"),
        (["--plot", "x.jpg"], "--plot expects a .png path"),
        (["--model-config", "/nonexistent/config.json"], "--model-config /nonexistent/config.json"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        ca.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_without_cuda_it_says_so_and_exits_2(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        ca.main(["--json", ""])
    assert exc.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_cli_on_a_cpu_writes_its_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    argv = ["--device", "cpu", "--shape", "small", "--rounds", "1", "--json", str(out), "--plot", str(png)]
    assert ca.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["measured"]["device"] == "cpu"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "for `kvmesh simulate --cost-model`" in capsys.readouterr().out


def test_the_cli_calibrates_the_shape_of_a_model_config(tiny_model_dir, tmp_path):
    out = tmp_path / "acc.json"
    argv = ["--device", "cpu", "--model-config", str(tiny_model_dir), "--rounds", "1", "--json", str(out)]
    assert ca.main(argv) == 0
    m = json.loads(out.read_text())["measured"]
    assert (m["shape_layers"], m["shape_vocab"], m["kv_bytes_per_token"]) == (2, 1024, 2 * 2 * 2 * 32 * 2)
    assert m["shape"] == str(tiny_model_dir)

"""The accelerator calibration on a CPU with a small shape: the same code path an H200 run takes, its
KV arithmetic, its output as a cost model, and its CLI errors."""

from __future__ import annotations

import json

import numpy as np
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


def _kkt_holds(columns, ys, coef, tol=1e-7) -> bool:
    """Whether `coef` satisfies the optimality conditions of non-negative least squares (independent of how it
    was found): every coefficient >= 0, the squared error's gradient 0 along those above 0 and >= 0 along those
    at 0. The columns are scaled to unit length first, so one tolerance fits terms of any magnitude."""
    a = np.asarray(columns, dtype=np.float64).T
    y = np.asarray(ys, dtype=np.float64)
    norms = np.linalg.norm(a, axis=0)
    gradient = (a / norms).T @ (a @ np.asarray(coef) - y)
    scale = tol * np.linalg.norm(y)
    return all(c >= 0 and (g >= -scale if c == 0 else abs(g) <= scale) for c, g in zip(coef, gradient))


def test_the_prefill_fit_is_the_non_negative_least_squares_optimum():
    """Dropping the free fit's most negative constant and refitting the rest was not the best non-negative fit
    where two were negative or dropping another fitted better (85 of 2000 noisy draws, up to 1.59 x the
    squared error)."""
    rng = np.random.default_rng(0)
    lengths = (512, 1024, 2048, 4096, 8192, 16384, 32768)
    xs = np.asarray(lengths, dtype=np.float64)
    columns = [np.ones_like(xs), xs, xs * xs / 2]
    failed = 0
    for _ in range(300):
        base, per_token, pair = rng.uniform(0, 0.01), rng.uniform(1e-6, 5e-5), rng.uniform(0, 2e-9)
        times = (base + xs * per_token + xs * xs / 2 * pair) * (1 + rng.normal(0, 0.1, len(xs)))
        failed += not _kkt_holds(columns, times, ca.fit_prefill(lengths, list(times)))
    assert failed == 0


def test_the_tiny_engine_line_is_the_best_one_with_non_negative_constants(monkeypatch):
    """calibrate.py clamped a negative slope to 0 keeping the intercept fitted beside it (above the mean of
    every measured time), and a negative intercept to 0 keeping its slope (too steep)."""
    from kvmesh.benchmarks import calibrate as cal

    def run(prefill_times):
        times = {f"prefill{n}": [t] for n, t in zip(cal.LENGTHS, prefill_times)}
        times.update({f"{case}{b}": [0.01] for case in ("one", "many") for b in (1, cal.BATCH)})
        monkeypatch.setattr(cal, "_engine", lambda *a, **k: None)
        monkeypatch.setattr(cal, "_timed", lambda *a, **k: (0.0, 0.0))
        monkeypatch.setattr(cal, "_rounds", lambda *a, **k: times)
        cm = cal.calibrate("model-dir")["cost_model"]
        return cm["prefill_base_s"], cm["prefill_s_per_token"]

    xs = np.asarray(cal.LENGTHS, dtype=np.float64)
    # per-step overhead dominates, the shortest prompt disturbed: the free slope is negative; the best
    # non-negative line is flat, through the mean
    noisy = [0.0060, 0.0031, 0.0032, 0.0033, 0.0034]
    assert run(noisy) == (pytest.approx(float(np.mean(noisy)), rel=1e-9), 0.0)
    # a convex curve (attention): the free intercept is negative; the best line through 0
    convex = list(0.0002 + 4e-6 * xs + 4e-9 * xs * xs)
    base, slope = run(convex)
    assert base == 0.0 and slope == pytest.approx(float(xs @ convex / (xs @ xs)), rel=1e-9)
    # exact data with constants >= 0 is recovered as it is
    assert run(list(0.001 + 1.2e-5 * xs)) == (pytest.approx(0.001), pytest.approx(1.2e-5))


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


def test_a_cuda_device_other_than_0_is_the_one_drained_captured_on_and_named(monkeypatch):
    """`--device cuda:1` synchronised device 0 around every timing, captured the decode graph on device 0's
    stream, and reported device 0's name. torch's CUDA calls are replaced, and the timed cases too (no GPU)."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", d)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: calls.append(("name", d)) or "GPU")

    def timed_once(value):
        def case(torch, model, *args):
            timed = args[-1]
            timed(lambda: None)
            return value(*args)

        return case

    monkeypatch.setattr(ca, "_Model", lambda *a: None)
    monkeypatch.setattr(ca, "_prefill", timed_once(lambda lengths, *a: {n: 1e-3 + 1e-5 * n for n in lengths}))
    monkeypatch.setattr(
        ca, "_prefill_after_prefix", timed_once(lambda suffix, prefixes, *a: {p: 0.01 for p in prefixes})
    )
    monkeypatch.setattr(ca, "_decode", timed_once(lambda *a: 0.01))
    monkeypatch.setattr(
        ca, "_host_load", lambda *a: {k: 1e-6 for k in ("pinned", "pinned_chunks_256", "pinned_chunks_16", "pageable")}
    )
    result = ca.calibrate("small", "cuda:1", lengths=(8, 16, 32), rounds=1, prefixes=(0, 8))

    def index(d):
        return d if isinstance(d, int) else None if d is None else torch.device(d).index

    assert [index(d) for kind, d in calls if kind == "set"] == [1]
    synced = [index(d) for kind, d in calls if kind == "sync"]
    assert synced and set(synced) == {1}
    assert [index(d) for kind, d in calls if kind == "name"] == [1]
    assert result["measured"]["device"] == "GPU" and result["measured"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("how", ["default shape", "model config"])
def test_a_cpu_run_of_a_full_size_shape_is_refused(how, monkeypatch, tmp_path, capsys):
    """`--device cpu` without `--shape small` built Llama-3-8B's shape in float32 (~30 GB) before timing."""

    def calibrated(*a, **k):
        raise AssertionError("a full-size shape was built on a CPU")

    monkeypatch.setattr(ca, "calibrate", calibrated)
    argv = ["--device", "cpu", "--json", ""]
    if how == "model config":
        s = ca.SHAPES["llama-8b"]
        config = {
            "num_hidden_layers": s.layers,
            "hidden_size": s.hidden,
            "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads,
            "intermediate_size": s.intermediate,
            "vocab_size": s.vocab,
        }
        (tmp_path / "config.json").write_text(json.dumps(config))
        argv += ["--model-config", str(tmp_path / "config.json")]
    with pytest.raises(SystemExit) as exc:
        ca.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "runs small shapes only" in err and "30.0 GB" in err and "--shape small" in err and err.count("\n") == 1


def test_the_default_lengths_measure_short_prompts(monkeypatch):
    """A fit over prompts of 512+ tokens extrapolated a 0 intercept to the few tokens a cache hit leaves to
    compute; a CUDA calibration times short prompts too, from the CLI or called."""
    import inspect

    import torch

    asked = {}

    def calibrated(shape, device, **kwargs):
        asked.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ca, "calibrate", calibrated)
    with pytest.raises(SystemExit):
        ca.main(["--json", ""])
    monkeypatch.undo()
    for lengths in (asked["lengths"], inspect.signature(ca.calibrate).parameters["lengths"].default):
        assert {16, 64, 128} <= set(lengths) and min(lengths) == 16 and max(lengths) == 32768


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

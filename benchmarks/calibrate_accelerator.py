"""Measure the time model's accelerator constants (policies/cost_model.py) on a CUDA device with PyTorch.

    python -m kvmesh.benchmarks.calibrate_accelerator [--shape llama-8b] [--json out/accelerator.json]

Why: `CostModel`'s defaults describe one accelerator per replica serving an ~8B model, and the
simulator's TTFT and every tier credit in the kvmesh policy follow from them: prefill seconds per
token, the decode step, and above all the ratio of loading a token's KV from host memory to
recomputing it (the policy scores a host-tier token at that fraction of a recomputed one). The
defaults were estimates. This measures them on the accelerator at hand without a vLLM build for it:
the same arithmetic vLLM's engine does for the model's shape (bf16 GEMMs, causal attention with
grouped KV heads, a CUDA-graph decode step), with random weights, since timing does not depend on
their values.

Method, each case timed `rounds` times after a warm-up, keeping the minimum (the least-disturbed run):
- prefill: one prompt of each length (`LENGTHS` by default, short ones included), every layer's
  projections, attention and MLP plus the logits of the last token; the least-squares fit, all three
  constants >= 0 (`fit_prefill`), of time = prefill_base_s + n * prefill_s_per_token
  + n^2 / 2 * attention_s_per_token_pair (causal attention: each token attends to those before it).
  With two lengths only the line is fitted. Then the same 512-token suffix behind cached prefixes of
  several lengths, the case of a cache hit (its kernel takes an explicit mask, so its attention is an
  upper bound on what the causal kernel does).
- decode: one step of `batch` sequences over a `context`-token KV cache, captured as a CUDA graph (as
  vLLM runs decode); the step time is `decode_s_per_token` (each sequence gets one token per step).
- host load: the KV of `tokens` prompt tokens (layers x 2 x kv_heads x head_dim bf16 values each) copied
  from pinned host memory to the device, as LMCache's host tier loads a hit: in one copy, in 256-token
  chunks (LMCache's default chunk: the `host_load_s_per_token` reported) and in 16-token ones; pageable
  memory beside them. The shared tier's network transfer is not measured here.
What it leaves out: vLLM's fused kernels and scheduler (its prefill is at least this fast), rotary
embeddings and sampling (small next to the GEMMs). On a CPU (`--device cpu --shape small`; a shape whose
float32 weights pass `CPU_MAX_WEIGHT_BYTES` is refused) it runs the same code at small sizes, for tests
only. `--model-config` takes the shape from a Hugging Face `config.json`, to calibrate the model actually
served. `--device cuda:N` times device N (made the current device: graphs and streams are made there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from kvmesh.benchmarks.calibrate import fit_line, fit_nonnegative
from kvmesh.policies.cost_model import DEFAULT_COST_MODEL


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_size: int = 0  # 0: hidden // heads (a config may name another, as some models do)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * element_bytes

    def weights(self) -> int:
        """How many weight values `_Model` builds for this shape (its layers' projections and MLP, and the
        logits head)."""
        h, hd = self.hidden, self.head_dim
        per_layer = h * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * h + 3 * h * self.intermediate
        return self.layers * per_layer + h * self.vocab


SHAPES = {
    # Llama-3-8B's published configuration
    "llama-8b": Shape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    # for tests on a CPU
    "small": Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512),
}


def shape_from_hf_config(path: str) -> Shape:
    """The decoder shape in a Hugging Face `config.json` (or a model directory holding one), for
    calibrating the model actually served. ValueError when it lacks a field a decoder needs."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from None
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    try:
        heads = int(cfg["num_attention_heads"])
        return Shape(
            layers=int(cfg["num_hidden_layers"]),
            hidden=int(cfg["hidden_size"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            head_size=int(cfg.get("head_dim") or 0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{file}: not a decoder config ({exc!r} missing or not a number)") from None


def _timer(torch, device: str) -> Callable[[Callable[[], object]], float]:
    """Wall seconds of one call, the device drained before and after it (`device` itself: a bare
    synchronize drains the current device, which is not the one timed under `--device cuda:1`)."""

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return timed


class _Model:
    """The model's weights and its forward pass: enough of a decoder to cost what one costs."""

    def __init__(self, torch, shape: Shape, device: str, dtype):
        self.t, self.s = torch, shape
        h, hd = shape.hidden, shape.head_dim
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*dims):
            return (torch.randn(*dims, device=device, dtype=dtype, generator=gen) * 0.02).contiguous()

        self.layers = [
            (
                w(h, (shape.heads + 2 * shape.kv_heads) * hd),  # q, k, v
                w(shape.heads * hd, h),  # attention output
                w(h, 2 * shape.intermediate),  # gate and up
                w(shape.intermediate, h),  # down
            )
            for _ in range(shape.layers)
        ]
        self.head = w(h, shape.vocab)

    def _norm(self, x):
        return x * self.t.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def forward(self, x, caches=None):
        """x: [batch, tokens, hidden]. Without `caches` the tokens attend to each other, causally (a
        prefill). With `caches` (per layer (k, v), [batch, kv_heads, context, head_dim]) a single token
        attends to the cache (a decode step: its own K and V left out, one of thousands), and several
        tokens to the cache and, causally, to each other (the prefill of a prompt whose first `context`
        tokens are cached). Returns the last token's logits."""
        t, s = self.t, self.s
        F = t.nn.functional
        from torch.nn.attention.bias import causal_lower_right

        b, n, _ = x.shape
        hd = s.head_dim
        for i, (wqkv, wo, w13, w2) in enumerate(self.layers):
            q, k, v = (self._norm(x) @ wqkv).split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
            q = q.view(b, n, s.heads, hd).transpose(1, 2)
            k = k.view(b, n, s.kv_heads, hd).transpose(1, 2)
            v = v.view(b, n, s.kv_heads, hd).transpose(1, 2)
            mask = None
            if caches is not None and n == 1:
                k, v = caches[i]
            elif caches is not None:
                k, v = t.cat([caches[i][0], k], dim=2), t.cat([caches[i][1], v], dim=2)
                mask = causal_lower_right(n, k.shape[2])
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=caches is None, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, n, s.heads * hd) @ wo
            gate, up = (self._norm(x) @ w13).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w2
        return self._norm(x[:, -1]) @ self.head


def _prefill(torch, model: _Model, lengths, rounds: int, device: str, dtype, timed) -> dict[int, float]:
    times: dict[int, float] = {}
    with torch.inference_mode():
        for n in lengths:
            x = torch.randn(1, n, model.s.hidden, device=device, dtype=dtype)
            model.forward(x)  # warm-up: kernels chosen and cached for this shape
            times[n] = min(timed(lambda x=x: model.forward(x)) for _ in range(rounds))
    return times


def _caches(torch, s: Shape, batch: int, context: int, device: str, dtype) -> list:
    """A KV cache of `context` tokens per sequence, per layer (random: timing does not read values)."""
    return [
        (
            torch.randn(batch, s.kv_heads, context, s.head_dim, device=device, dtype=dtype),
            torch.randn(batch, s.kv_heads, context, s.head_dim, device=device, dtype=dtype),
        )
        for _ in range(s.layers)
    ]


def _prefill_after_prefix(torch, model: _Model, suffix: int, prefixes, rounds: int, device: str, dtype, timed) -> dict:
    """Seconds to prefill `suffix` new tokens behind each cached prefix length (0: nothing cached). The
    cost model charges only the new tokens; their attention also reads the cached prefix."""
    times = {}
    with torch.inference_mode():
        x = torch.randn(1, suffix, model.s.hidden, device=device, dtype=dtype)
        for p in prefixes:
            caches = _caches(torch, model.s, 1, p, device, dtype) if p else None
            model.forward(x, caches)
            times[p] = min(timed(lambda caches=caches: model.forward(x, caches)) for _ in range(rounds))
            del caches
    return times


def _decode(torch, model: _Model, batch: int, context: int, rounds: int, device: str, dtype, timed) -> float:
    caches = _caches(torch, model.s, batch, context, device, dtype)
    x = torch.randn(batch, 1, model.s.hidden, device=device, dtype=dtype)
    with torch.inference_mode():
        step: Callable[[], object] = lambda: model.forward(x, caches)  # noqa: E731
        step()
        if device.startswith("cuda"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.forward(x, caches)
            step = graph.replay
            step()
        return min(timed(step) for _ in range(rounds))


# The most float32 weight bytes a run off CUDA builds: a CPU run tests the code (the small shape's are 1.4 MB);
# Llama-3-8B's shape there would allocate ~30 GB before timing anything
CPU_MAX_WEIGHT_BYTES = 1 << 30

LOAD_CHUNK_TOKENS = 256  # LMCache's default chunk: a host-tier hit loads chunk by chunk


def _host_load(torch, shape: Shape, tokens: int, rounds: int, device: str, timed) -> dict[str, float]:
    """Seconds per token to bring KV from host memory to the device: pinned in one copy, pinned in
    chunks of `LOAD_CHUNK_TOKENS` and of 16 tokens (one copy per chunk, as a per-chunk store loads), and
    pageable in one copy."""
    per_token = shape.kv_bytes_per_token()
    size = tokens * per_token
    target = torch.empty(size, dtype=torch.uint8, device=device)
    cuda = device.startswith("cuda")

    def copy(src, chunk_tokens: int, pin: bool):
        step = chunk_tokens * per_token
        for i in range(0, size, step):
            target[i : i + step].copy_(src[i : i + step], non_blocking=pin)

    out = {}
    cases = [
        ("pinned", tokens, True),
        (f"pinned_chunks_{LOAD_CHUNK_TOKENS}", LOAD_CHUNK_TOKENS, True),
        ("pinned_chunks_16", 16, True),
        ("pageable", tokens, False),
    ]
    pinned = torch.ones(size, dtype=torch.uint8, pin_memory=cuda)
    for kind, chunk, pin in cases:
        src = pinned if pin else torch.ones(size, dtype=torch.uint8)
        pin = pin and cuda
        copy(src, chunk, pin)  # warm-up
        out[kind] = (
            min(timed(lambda src=src, chunk=chunk, pin=pin: copy(src, chunk, pin)) for _ in range(rounds)) / tokens
        )
    return out


def fit_prefill(lengths, times) -> tuple[float, float, float]:
    """(prefill_base_s, prefill_s_per_token, attention_s_per_token_pair) by least squares over
    time = base + n * per_token + n^2 / 2 * pair; with fewer than three lengths a line (pair 0). The
    constants are the best fit with all three >= 0 (non-negative least squares, `fit_nonnegative`): a
    free fit's negative one (noise on a short range, or a convex curve's intercept) is no engine's."""
    xs = np.asarray(lengths, dtype=np.float64)
    columns = [np.ones_like(xs), xs, xs * xs / 2] if len(set(lengths)) >= 3 else [np.ones_like(xs), xs]
    coef = fit_nonnegative([c.tolist() for c in columns], times) + [0.0]
    return coef[0], coef[1], coef[2]


# Prompt lengths timed by default. The short ones (16-128 tokens) measure what a prefill costs when a cache
# hit leaves only a few tokens to compute: the weights are read once per forward pass however short it is,
# a floor a fit over long prompts alone does not see (the H200 run's, over 512+ tokens, has an intercept of 0).
LENGTHS = (16, 64, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def calibrate(
    shape_name: str | Shape = "llama-8b",
    device: str = "cuda",
    lengths=LENGTHS,
    batch: int = 64,
    context: int = 2048,
    load_tokens: int = 16384,
    rounds: int = 5,
    suffix: int = 512,
    prefixes=(0, 2048, 8192, 32768),
    label: str | None = None,
) -> dict:
    import torch

    if device.startswith("cuda") and torch.device(device).index is not None:
        # the device named, not device 0, is where the graphs are captured and the streams made (current
        # device), as well as where the tensors are
        torch.cuda.set_device(torch.device(device).index)
    shape = shape_name if isinstance(shape_name, Shape) else SHAPES[shape_name]
    shape_name = label or ("custom" if isinstance(shape_name, Shape) else shape_name)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    timed = _timer(torch, device)
    model = _Model(torch, shape, device, dtype)
    prefill = _prefill(torch, model, lengths, rounds, device, dtype, timed)
    base, per_token, pair = fit_prefill(list(prefill), list(prefill.values()))
    line_base, line_per_token = fit_line(list(prefill), list(prefill.values()))
    behind = _prefill_after_prefix(torch, model, suffix, prefixes, rounds, device, dtype, timed)
    decode = _decode(torch, model, batch, context, rounds, device, dtype, timed)
    load = _host_load(torch, shape, load_tokens, rounds, device, timed)
    cost = {
        "prefill_s_per_token": per_token,
        "prefill_base_s": base,
        "attention_s_per_token_pair": pair,
        "decode_s_per_token": decode,
        "host_load_s_per_token": load[f"pinned_chunks_{LOAD_CHUNK_TOKENS}"],
    }
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {
        "cost_model": cost,
        "measured": {
            "device": name,
            "shape": shape_name,
            **{f"shape_{k}": v for k, v in asdict(shape).items()},
            "kv_bytes_per_token": shape.kv_bytes_per_token(),
            "dtype": str(dtype).removeprefix("torch."),
            "prefill_s_by_length": {str(n): t for n, t in prefill.items()},
            "prefill_s_per_token_by_length": {str(n): t / n for n, t in prefill.items()},
            "prefill_line": {"prefill_base_s": line_base, "prefill_s_per_token": line_per_token},
            "suffix_tokens": suffix,
            "suffix_prefill_s_by_cached_prefix": {str(p): t for p, t in behind.items()},
            # the suffix's extra time per (suffix token, cached token) pair over the suffix alone
            "suffix_attention_s_per_token_pair": {
                str(p): (t - behind[0]) / (suffix * p) for p, t in behind.items() if p and 0 in behind
            },
            "decode_batch": batch,
            "decode_context": context,
            "host_load_s_per_token": load,
            "host_load_over_recompute": cost["host_load_s_per_token"] / per_token if per_token > 0 else math.inf,
            "time_basis": f"minimum wall time over {rounds} rounds after a warm-up",
        },
        "defaults": DEFAULT_COST_MODEL.to_dict(),
    }


def _report(result: dict) -> str:
    cm, m, d = result["cost_model"], result["measured"], result["defaults"]
    lines = [f"{m['device']}, {m['shape']} shape, {m['dtype']}:"]
    for n, t in m["prefill_s_by_length"].items():
        lines.append(
            f"  prefill {n:>5} tokens  {1000 * t:8.2f} ms  ({1e6 * m['prefill_s_per_token_by_length'][n]:.2f} us/token)"
        )
    line = m["prefill_line"]
    lines.append(
        f"  a line through them: {1000 * line['prefill_base_s']:.2f} ms"
        f" + {1e6 * line['prefill_s_per_token']:.2f} us/token"
    )
    behind = m["suffix_prefill_s_by_cached_prefix"]
    alone = behind.get("0")
    pairs = m["suffix_attention_s_per_token_pair"]
    for p, t in behind.items():
        vs = f"  ({t / alone:.2f} x with nothing cached)" if alone else ""
        per_pair = f", {1e9 * pairs[p]:.2f} ns per (new, cached) token pair" if p in pairs else ""
        lines.append(
            f"  prefill {m['suffix_tokens']} new tokens behind {p:>5} cached: {1000 * t:8.2f} ms{vs}{per_pair}"
        )
    lines.append(
        f"  decode step, {m['decode_batch']} sequences x {m['decode_context']} context: "
        f"{1000 * cm['decode_s_per_token']:.2f} ms"
    )
    b = m["kv_bytes_per_token"]
    lines.append(f"  host -> device KV ({b} B/token):")
    for kind, t in m["host_load_s_per_token"].items():
        lines.append(f"    {kind:<20} {1e6 * t:8.3f} us/token  ({b / t / 1e9:6.1f} GB/s)")
    lines.append("constant                      measured      default   measured/default")
    for k, v in cm.items():
        lines.append(f"  {k:<27} {v:11.3e}  {d[k]:11.3e}   {f'{v / d[k]:.2f}' if d[k] else '-'}")
    ratio = m["host_load_over_recompute"]
    default_ratio = d["host_load_s_per_token"] / d["prefill_s_per_token"]
    lines.append(f"  host load / recompute: measured {ratio:.4f}, default {default_ratio:.4f}")
    lines.append("for `kvmesh simulate --cost-model`: " + json.dumps(cm))
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Prefill time against prompt length (measured, the fit, the line through prompts up to 8k, the default
    model) and the suffix behind cached prefixes, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm, m, d = result["cost_model"], result["measured"], result["defaults"]
    n = np.array([int(k) for k in m["prefill_s_by_length"]], dtype=np.float64)
    t = np.array(list(m["prefill_s_by_length"].values()))
    grid = np.linspace(0, n.max(), 200)
    fit = cm["prefill_base_s"] + grid * cm["prefill_s_per_token"] + grid * grid / 2 * cm["attention_s_per_token_pair"]
    short = n <= 8192
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(n, t, "o", color="black", label="measured")
    a.plot(grid, fit, "-", label="fit: per token + per (token, earlier token) pair")
    if short.sum() >= 2:
        base, per_token = fit_line(list(n[short]), list(t[short]))
        a.plot(grid, base + grid * per_token, "--", label="a line through prompts up to 8k tokens")
    a.plot(grid, d["prefill_base_s"] + grid * d["prefill_s_per_token"], ":", label="the default cost model")
    a.set(xlabel="prompt tokens (nothing cached)", ylabel="prefill s", title=f"{m['device']}, {m['shape']} shape")
    a.legend(fontsize=8)
    behind = m["suffix_prefill_s_by_cached_prefix"]
    b.bar([str(k) for k in behind], [1000 * v for v in behind.values()], color="tab:blue")
    b.set(
        xlabel="cached prefix tokens",
        ylabel="ms",
        title=f"prefill of {m['suffix_tokens']} new tokens behind a cached prefix",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument(
        "--model-config", default=None, help="a Hugging Face config.json (or model dir): its shape, not --shape's"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default=None, help="prefill prompt lengths, comma-separated")
    parser.add_argument("--batch", type=int, default=None, help="sequences in the decode step")
    parser.add_argument("--context", type=int, default=None, help="KV cache tokens per sequence in the decode step")
    parser.add_argument("--json", default="out/accelerator.json")
    parser.add_argument("--plot", default=None, help="also draw the prefill figures to this .png")
    args = parser.parse_args(argv)
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.exit(2, f"calibrate_accelerator: --plot expects a .png path, got {args.plot!r}\n")
    small = not args.device.startswith("cuda")  # a CPU run is a test of the code: small sizes throughout
    shape: str | Shape = args.shape
    if args.model_config:
        try:
            shape = shape_from_hf_config(args.model_config)
        except ValueError as exc:
            parser.exit(2, f"calibrate_accelerator: --model-config {exc}\n")
    weight_bytes = 4 * (shape if isinstance(shape, Shape) else SHAPES[shape]).weights()  # float32 off CUDA
    if small and weight_bytes > CPU_MAX_WEIGHT_BYTES:
        parser.exit(
            2,
            f"calibrate_accelerator: --device {args.device} runs small shapes only, to test the code: this shape's"
            f" weights take {weight_bytes / 1e9:.1f} GB in float32 (use --shape small, or a CUDA device)\n",
        )
    try:
        lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else None
    except ValueError:
        lengths = ()
    if lengths is not None and (len(set(lengths)) < 2 or min(lengths) < 1):
        parser.exit(
            2, "calibrate_accelerator: --lengths takes two or more distinct positive integers, comma-separated\n"
        )
    if (
        args.rounds < 1
        or (args.batch is not None and args.batch < 1)
        or (args.context is not None and args.context < 1)
    ):
        parser.exit(2, "calibrate_accelerator: --rounds, --batch and --context must be >= 1\n")
    try:
        import torch
    except ImportError:
        parser.exit(2, "calibrate_accelerator: PyTorch is not installed\n")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.exit(2, "calibrate_accelerator: no CUDA device (use --device cpu --shape small to try it)\n")
    result = calibrate(
        shape,
        args.device,
        lengths=lengths or ((16, 32, 64) if small else LENGTHS),
        batch=args.batch or (4 if small else 64),
        context=args.context or (64 if small else 2048),
        load_tokens=256 if small else 16384,
        rounds=args.rounds,
        suffix=8 if small else 512,
        prefixes=(0, 16, 64) if small else (0, 2048, 8192, 32768),
        label=args.model_config,
    )
    print(_report(result))
    if args.json:
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    if args.plot:
        if os.path.dirname(args.plot):
            os.makedirs(os.path.dirname(args.plot), exist_ok=True)
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

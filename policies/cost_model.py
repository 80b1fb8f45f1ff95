"""The time model shared by the kvmesh policy and the trace simulator: one place for its constants.

Why one place: the policy predicts TTFT from the constants the simulator delivers it with, and both
are later calibrated from the live engines (`CostModel.from_dict` takes measured values). If the two
drifted apart the simulator would flatter or punish the policy for reasons unrelated to placement.

What the policy counts (`policies/score_kernel.py`) is not all the simulator charges: its own request's
prefill is `prefill_s` in full (attention term included), but the work queued ahead of it on a replica
is linear, pending tokens x `prefill_s_per_token` + queued requests x `prefill_base_s`, without the
attention term the simulator charges each queued request (`prefill_s`). Where that term is large the
policy can pick the slower replica: with the H200 constants, a 512-token prompt behind one queued
32k-token prompt (r0) or behind forty queued 1000-token ones (r1) is predicted 0.854 s on r0 and 1.040 s
on r1, and the simulator delivers 1.341 s and 1.058 s.

Defaults describe one accelerator per replica serving an ~8B model (one H100-class GPU), as estimates;
an H200 measured for an 8B shape (`benchmarks/calibrated/h200_llama8b.json`, docs/calibration.md)
prefills ~3.9x faster, decodes a 64-sequence step in 10 ms and loads a host-tier token at 1/11 of
recomputing it, and kvmesh places about as well under either set:
- prefill ~10k tokens/s => `prefill_s_per_token` = 1e-4 s, plus `prefill_base_s` = 10 ms per
  request (scheduling, first sampling step);
- decode: `decode_s_per_token` = 25 ms per output token per sequence (TPOT at a typical batch);
- a KV block already in the node's host DRAM (LMCache L1) loads over PCIe: ~128 KiB of KV per token
  at ~25 GB/s => ~5e-6 s/token (`host_load_s_per_token`, 1/20 of recomputing it);
- a KV block in the shared tier (LMCache L2 over the network) ~5 GB/s => 2.5e-5 s/token (1/4).
- `max_batch` = 64 sequences in flight per replica (vLLM's max_num_seqs is 256; long Mooncake
  prompts fill the KV space well before that).
- `attention_s_per_token_pair` = 0: each computed prompt token also attends to every token before it,
  cached or not, so a prefill costs that much more per (computed token, earlier token) pair. 0 keeps the
  model linear in computed tokens. Measured on an H200 for an 8B shape it is ~0.9 ns
  (`benchmarks/calibrate_accelerator.py`): a 32k-token prefill then costs 1.4 x what the per-token rate of
  short prompts predicts, and the bundled Mooncake traces' prefill work 1.4-1.5 x (docs/calibration.md).
All are plain seconds; see docs/simulator.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TypeGuard, TypeVar

log = logging.getLogger(__name__)


def finite_number(v: object) -> TypeGuard[int | float]:
    """Whether `v` is a number (an int or a float, not a bool) that is finite as a float: NaN passes `v < 0`,
    and an infinity or a 400-digit integer overflows every sum it enters."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _shown(v: object) -> str:
    from kvmesh.cluster.trace import brief  # here, not at the top: kvmesh.cluster.trace imports this module

    return brief(repr(v))


# The largest weight a policy's score takes on one of its terms: far above any tuned one (kvmesh's are 3-31),
# and far below where a weight times seconds of prefill overflows to inf (every replica then ties)
MAX_WEIGHT = 1e6


def check_param(
    policy: str,
    name: str,
    value: object,
    low: float = 0.0,
    high: float = math.inf,
    *,
    above: bool = False,
    whole: bool = False,
) -> None:
    """ValueError '<policy>: <name> must be ...' unless `value` is a finite number (`finite_number`) >= `low`
    (> `low` when `above`), <= `high`, and an int when `whole`. Why: a `value < 0` check lets NaN through, and a
    policy built with NaN, an infinity or a string ranks replicas by numbers that mean nothing."""
    if (
        finite_number(value)
        and (value > low if above else value >= low)
        and value <= high
        and (isinstance(value, int) or not whole)
    ):
        return
    bounds = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
    kind = "a whole number" if whole else "a finite number"
    raise ValueError(f"{policy}: {name} must be {kind} {bounds}, got {_shown(value)}")


def check_flag(policy: str, name: str, value: object) -> None:
    """ValueError unless `value` is a bool: "false" in a config is a string, and a string is true."""
    if not isinstance(value, bool):
        raise ValueError(f"{policy}: {name} must be true or false, got {type(value).__name__}")


_N = TypeVar("_N", int, float)


def _constant(default: _N, most: _N, plausible: float | None = None, unit: str = "") -> _N:
    """A cost model field whose value may be at most `most`: far above any engine's (calibrated: an H200 prefills
    an 8B model's token in 2.6e-5 s, the tiny CPU engine its own in 1.2e-5 s), and low enough that a long trace's
    times stay finite and keep their milliseconds (a constant of 1e308 made every TTFT inf, and utilisation NaN).
    `plausible`: the most `CostModel.from_dict` takes from measured or typed-in values, in `unit`; a value
    above it is no engine's and most likely milliseconds given where seconds are meant."""
    return field(default=default, metadata={"max": most, "plausible": plausible, "unit": unit})


@dataclass(frozen=True, slots=True)
class CostModel:
    # The plausible bounds (the third argument) are 10x or more the slowest figure measured for each field
    # (docs/calibration.md): a token prefilled or loaded in 0.1 s (the live tiny-model path, 4 engines on 2
    # cores: 1.3e-4 s), a fixed per-request part of 1 s (that path: 0.05-0.1 s; an engine alone 0-3 ms) and a
    # decode step of 1 s (2 ms on the CPU engine, 7.7-15.4 ms on an H200). A base or a decode step written in
    # milliseconds (10 for 10 ms) is above them and refused, not taken as 10 s.
    prefill_s_per_token: float = _constant(1e-4, 1.0, 0.1, "s per token")
    prefill_base_s: float = _constant(0.010, 60.0, 1.0, "s per request")
    decode_s_per_token: float = _constant(0.025, 10.0, 1.0, "s per output token (one decode step)")
    host_load_s_per_token: float = _constant(5e-6, 1.0, 0.1, "s per token")
    shared_load_s_per_token: float = _constant(2.5e-5, 1.0, 0.1, "s per token")
    max_batch: int = _constant(64, 1_000_000)
    attention_s_per_token_pair: float = _constant(0.0, 1e-3)

    def __post_init__(self):
        for f in fields(self):  # else requests are placed by numbers that mean nothing
            whole = f.name == "max_batch"  # a count of sequences
            check_param("cost model", f.name, getattr(self, f.name), int(whole), f.metadata["max"], whole=whole)

    def prefill_s(self, num_tokens: int, hbm_tokens: int = 0, host_tokens: int = 0, shared_tokens: int = 0) -> float:
        """Seconds to prefill a prompt whose first tokens are cached (cumulative per tier:
        hbm <= host <= shared <= num_tokens): recompute the rest, load the tier parts."""
        return (
            self.prefill_base_s
            + (num_tokens - shared_tokens) * self.prefill_s_per_token
            + (shared_tokens - host_tokens) * self.shared_load_s_per_token
            + (host_tokens - hbm_tokens) * self.host_load_s_per_token
            + self.attention_s(num_tokens, shared_tokens)
        )

    def attention_s(self, num_tokens: int, cached_tokens: int = 0) -> float:
        """The attention part of a prefill: tokens cached_tokens..num_tokens-1 each attend to every token
        before them, about (num_tokens^2 - cached_tokens^2) / 2 pairs. 0.0 when the model is linear."""
        if not self.attention_s_per_token_pair:
            return 0.0
        pairs = (float(num_tokens) * num_tokens - float(cached_tokens) * cached_tokens) * 0.5
        return pairs * self.attention_s_per_token_pair

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict | None) -> CostModel:
        """Build from (possibly partial) measured values; unknown keys are an error, not ignored.

        A calibrator's result document (`benchmarks/calibrate.py`, `calibrate_accelerator.py` with --json: the
        constants under "cost_model", beside "measured" and "defaults") is taken as its "cost_model" object.
        ValueError for a value above its field's plausible bound (`_constant`): most likely milliseconds where
        seconds are meant. The fields not given keep their defaults (an ~8B model on an H100-class GPU), said in
        one warning where some were given: a calibration that measured some constants leaves the others at
        another machine's."""
        values = dict(values or {})
        if "cost_model" in values:  # a calibrator's document: its other keys describe the measurement
            inner = values["cost_model"]
            if not isinstance(inner, dict):
                raise ValueError(f"cost model: 'cost_model' must be an object of constants, got {type(inner).__name__}")
            beside = set(values) - {"cost_model", *CALIBRATION_KEYS}
            if beside:  # a constant added beside the document's own would be dropped unseen, a typo too
                raise ValueError(
                    f"cost model: keys {sorted(beside)} beside 'cost_model' in a calibrator's document (which holds "
                    f"only {sorted(CALIBRATION_KEYS)} beside it): put constants inside 'cost_model'"
                )
            values = dict(inner)
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"cost model: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        cost = replace(cls(), **values)
        for f in fields(cls):
            most, unit = f.metadata["plausible"], f.metadata["unit"]
            if f.name in values and most is not None and getattr(cost, f.name) > most:
                raise ValueError(
                    f"cost model: {f.name} = {_shown(values[f.name])} {unit} is above {most:g} {unit}, slower than"
                    f" any engine: the constants are in seconds (10 ms is 0.01)"
                )
        missing = tuple(f.name for f in fields(cls) if f.name not in values)
        if values and missing and missing not in _DEFAULTS_SAID:  # none given: the defaults were asked for
            _DEFAULTS_SAID.add(missing)  # once per process: a config is checked several times on the way to Serve
            log.warning(
                "cost model: %s not given, taken from the defaults (an ~8B model on an H100-class GPU)",
                ", ".join(missing),
            )
        return cost


DEFAULT_COST_MODEL = CostModel()

# What a calibrator's result document holds beside its "cost_model" (`benchmarks/calibrate.py`,
# `benchmarks/calibrate_accelerator.py` with --json): the measurements, and the constants it did not measure
CALIBRATION_KEYS = frozenset({"measured", "defaults"})
# The sets of constants left at their defaults that this process has warned of
_DEFAULTS_SAID: set[tuple[str, ...]] = set()


def cached_tokens(matched_blocks: int, num_tokens: int, block_size: int) -> int:
    """Prompt tokens served from cache for a prefix of `matched_blocks` full blocks. vLLM always
    computes the last prompt token (it needs its logits) and hits whole blocks only, so at most
    floor((num_tokens - 1) / block_size) blocks count."""
    return max(0, min(matched_blocks, (num_tokens - 1) // block_size)) * block_size


def cacheable_blocks(num_tokens: int, num_block_ids: int, block_size: int) -> int:
    """How many of a request's blocks are full (only full blocks are cached and shared)."""
    return min(num_block_ids, num_tokens // block_size)

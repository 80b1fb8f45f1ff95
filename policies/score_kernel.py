"""kvmesh's per-replica score, compiled: one pass over the replicas instead of ~30 numpy operations.

Why compiled: at hundreds of replicas each numpy operation costs about a microsecond of dispatch, so the
score's thirty-odd array operations were most of a placement decision (the 1M-request x 256-replica
simulation spent half its time there). One numba loop computes the same formula, operation for
operation in the same order and with the same rounding, so every score is bit-identical to the numpy
expression of it (tests/unit/policies/test_score_kernel.py checks that on random fleets). The formula
and why each term is there are in `kvmesh.policies.kvmesh`; this module only evaluates it. The live
router and the simulator both call it through `KvmeshPolicy`.

Compiled on first use and cached on disk beside this file (numba's cache, or its user-wide one where
this folder is read-only), so a process pays the compilation once per machine, not per request.
"""

from __future__ import annotations

import numpy as np
from numba import njit  # type: ignore[import-untyped]


def _compiled(fn):
    """`fn` compiled by numba, cached on disk where numba finds a writable place for it (beside this file,
    or its user-wide cache); where it finds none (a read-only install without a writable home) numba
    refuses `cache=True` outright, so each process compiles it for itself instead."""
    try:
        return njit(cache=True, nogil=True)(fn)
    except RuntimeError:
        return njit(nogil=True)(fn)


SCORE_ROUNDING = 1e9  # scores are rounded to 1e-9 s, so sums that differ in the last bit tie


@_compiled
def _pos(x):
    """np.maximum(x, 0.0) for one float: NaN stays NaN."""
    return x if (x >= 0.0 or x != x) else 0.0


@_compiled
def replica_scores(
    shared_b,
    host_b,
    hbm_b,
    has_host,
    has_hbm,
    queued,
    running,
    pending,
    n,
    bs,
    p,
    base,
    shared_load,
    host_load,
    attn,
    max_batch,
    slot_wait,
    ready_s,
    rw,
    hot,
    hot_discount,
    spread,
    spread_w,
    recent,
    recent_bound,
    d,
    guard,
    gw,
    bound,
    work,
    ow,
    cap,
    rounding,
):
    """(score, uncached tokens, wait, ttft) per replica, as `KvmeshPolicy` defines them.

    `p`, `base`, `shared_load`, `host_load`, `attn`, `max_batch`: the cost model's (`CostModel`; `attn` its
    attention_s_per_token_pair, 0: no attention term); `slot_wait`: the
    wait per request over a full batch. `rw`: recompute_weight; `spread_w`, `recent_bound`, `d`: the
    short window's weight, bound and decay; `gw`, `bound`: the guard's weight and bound; `ow`, `cap`:
    overshoot_weight and overshoot_cap x the mean; `rounding`: 10^decimals the score is rounded to (0:
    none). `has_host` / `has_hbm`: the tier differs from the one
    above it (else its term is skipped, as the numpy form skips it when the arrays are one object). `hot`: blocks of the
    cached prefix ending at a fork (0: none); `hot_discount` < 0: no copy needed (cost untouched).
    `spread` / `guard` / `ow` > 0 switch their terms on. `ready_s` != 0: the prefill
    starts no earlier."""
    m = shared_b.shape[0]
    most = max(0, (n - 1) // bs)  # vLLM: whole blocks only, last token always computed
    nn = float(n) * float(n)
    full = False
    for k in range(m):
        if queued[k] + running[k] > max_batch - 1:
            full = True
            break
    score = np.empty(m)
    uncached = np.empty(m, dtype=np.int64)
    wait_out = np.empty(m)
    ttft_out = np.empty(m)
    for k in range(m):
        shared = min(shared_b[k], most) * bs
        host = min(host_b[k], most) * bs if has_host else shared
        hbm = min(hbm_b[k], most) * bs if has_hbm else host
        wait = pending[k] * p + queued[k] * base
        if full:
            over_b = queued[k] + running[k] + (1 - max_batch)
            wait = wait + max(over_b, 0) * slot_wait
        if ready_s != 0.0:
            wait = wait if (wait >= ready_s or wait != wait) else ready_s
        unc = n - shared
        ttft = wait + base + unc * p
        if has_host:
            ttft = ttft + (shared - host) * shared_load
        if has_hbm:
            ttft = ttft + (host - hbm) * host_load
        if attn != 0.0:
            ttft = ttft + (nn - float(shared) * float(shared)) * 0.5 * attn
        cost = rw * unc
        s = ttft
        if hot > 0:
            missing = (hot - min(shared_b[k], hot)) * bs
            missing = min(missing, unc)
            if hot_discount >= 0.0:
                cost = cost - hot_discount * missing
            s = s - missing * p
            if spread:
                cost = cost + spread_w * (d * _pos(recent[k] - recent_bound))
        if guard:
            cost = cost + gw * _pos(work[k] - bound)
            if ow > 0.0:
                cost = cost + ow * (_pos(work[k] + unc - cap) - _pos(work[k] - cap))
        s = s + p * cost
        score[k] = np.rint(s * rounding) / rounding if rounding > 0.0 else s  # np.round(s, 9) for 1e9
        uncached[k] = unc
        wait_out[k] = wait
        ttft_out[k] = ttft
    return score, uncached, wait_out, ttft_out


@_compiled
def lowest(score):
    """(index of the first lowest score, how many scores equal it), or (-1, 0) when a score is NaN: what
    `np.flatnonzero(score == score.min())` tells, in one pass."""
    first = -1
    count = 0
    low = np.inf
    for k in range(score.shape[0]):
        s = score[k]
        if s != s:
            return -1, 0
        if first < 0 or s < low:
            first, low, count = k, s, 1
        elif s == low:
            count += 1
    return first, count


_warm = False


def warm_up() -> None:
    """Load (or compile) both kernels for the argument types the policy passes them, once per process, so
    the first request a process places does not wait for it (about 0.4 s from numba's cache here, 1.2 s
    compiling). `KvmeshPolicy` calls it when it is made: a router or a simulation makes its policy before
    its first request."""
    global _warm
    if _warm:
        return
    counts = np.zeros(1, dtype=np.int64)
    floats = np.zeros(1)
    replica_scores(
        counts, counts, counts, False, False, counts, counts, counts, 2, 1, 1.0, 1.0, 1.0, 1.0, 0.0, 1, 1.0, 0.0,
        1.0, 0, -1.0, False, 1.0, floats, 0.0, 1.0, False, 1.0, 0.0, floats, 0.0, 0.0, SCORE_ROUNDING,
    )  # fmt: skip
    lowest(floats)
    _warm = True

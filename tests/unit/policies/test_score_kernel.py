"""The compiled score (`policies/score_kernel.py`) is bit for bit the numpy expression of kvmesh's formula,
on random fleets with every term switched on and off, rounded as the policy rounds it and unrounded
(where a change of operation order would show in the last bit); and `lowest` finds what numpy's min and
flatnonzero find."""

import numpy as np
import pytest

from kvmesh.policies.score_kernel import lowest, replica_scores


def numpy_scores(sb, hb, mb, has_host, has_hbm, queued, running, pending, n, bs, cost, ready_s, rw, hot, disc,
                 spread, sw, recent, recent_bound, d, guard, gw, bound, work, ow, cap, rounding):  # fmt: skip
    """kvmesh's score as numpy operations, in the order the policy's docstring gives them."""
    p, base, shared_load, host_load, attn, max_batch, slot_wait = cost
    most = max(0, (n - 1) // bs)
    shared = np.minimum(sb, most) * bs
    host = np.minimum(hb, most) * bs if has_host else shared
    hbm = np.minimum(mb, most) * bs if has_hbm else host
    wait = pending * p + queued * base
    busy = queued + running
    if busy.max() > max_batch - 1:
        wait = wait + np.maximum(busy + (1 - max_batch), 0) * slot_wait
    if ready_s:
        wait = np.maximum(wait, ready_s)
    uncached = n - shared
    ttft = wait + base + uncached * p
    if has_host:
        ttft = ttft + (shared - host) * shared_load
    if has_hbm:
        ttft = ttft + (host - hbm) * host_load
    if attn:
        ttft = ttft + (float(n) * float(n) - shared.astype(np.float64) * shared.astype(np.float64)) * 0.5 * attn
    cost_ = rw * uncached
    score = ttft
    if hot:
        missing = np.minimum((hot - np.minimum(sb, hot)) * bs, uncached)
        if disc >= 0:
            cost_ = cost_ - disc * missing
        score = score - missing * p
        if spread:
            cost_ = cost_ + sw * (d * np.maximum(recent - recent_bound, 0.0))
    if guard:
        cost_ = cost_ + gw * np.maximum(work - bound, 0.0)
        if ow:
            cost_ = cost_ + ow * (np.maximum(work + uncached - cap, 0.0) - np.maximum(work - cap, 0.0))
    score = score + p * cost_
    return (np.round(score, 9) if rounding else score), uncached, wait, ttft


def _case(rng, m):
    ints = lambda hi: rng.integers(0, hi, m).astype(np.int64)  # noqa: E731
    sb = ints(40)
    hb = np.minimum(sb, ints(40))
    mb = np.minimum(hb, ints(40))
    has_host, has_hbm = bool(rng.integers(2)), bool(rng.integers(2))
    queued, running = ints(6), ints(6)
    pending = ints(5000)
    n = int(rng.integers(1, 1300))
    bs = int(rng.choice([16, 32, 64]))
    cost = (
        float(rng.uniform(1e-5, 1e-3)),
        float(rng.uniform(1e-3, 3e-2)),
        float(rng.uniform(0, 1e-4)),
        float(rng.uniform(0, 1e-5)),
        float(rng.choice([0.0, rng.uniform(0, 2e-9)])),
        int(rng.integers(1, 9)),
        float(rng.uniform(0, 0.05)),
    )
    ready_s = float(rng.choice([0.0, rng.uniform(0, 0.5)]))
    hot = int(rng.choice([0, rng.integers(1, 30)]))
    disc = float(rng.choice([-1.0, 0.0, 20.0]))
    spread = bool(rng.integers(2))
    recent = rng.uniform(0, 3000, m)
    work = rng.uniform(0, 30000, m)
    mean = float(work.mean())
    return dict(
        sb=sb, hb=hb, mb=mb, has_host=has_host, has_hbm=has_hbm, queued=queued, running=running,
        pending=pending, n=n, bs=bs, cost=cost, ready_s=ready_s, rw=float(rng.choice([0.0, 30.0, 7.5])),
        hot=hot, disc=disc, spread=spread, sw=float(rng.choice([0.0, 31.0])), recent=recent,
        recent_bound=float(recent.mean() * 1.1), d=float(rng.uniform(0.9, 1.0)), guard=bool(rng.integers(2)),
        gw=float(rng.choice([0.0, 30.0])), bound=1.1 * mean, work=work,
        ow=float(rng.choice([0.0, 3.0])), cap=1.25 * mean, rounding=float(rng.choice([0.0, 1e9])),
    )  # fmt: skip


def _kernel(c):
    return replica_scores(*_kernel_args(c))


def _kernel_args(c):
    return (
        c["sb"], c["hb"], c["mb"], c["has_host"], c["has_hbm"], c["queued"], c["running"], c["pending"],
        c["n"], c["bs"], *c["cost"], c["ready_s"], c["rw"], c["hot"], c["disc"], c["spread"], c["sw"],
        c["recent"], c["recent_bound"], c["d"], c["guard"], c["gw"], c["bound"], c["work"], c["ow"], c["cap"],
        c["rounding"],
    )  # fmt: skip


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype.kind == b.dtype.kind and (a.tobytes() == b.tobytes())


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_score_equals_the_numpy_formula_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    for m in (1, 3, 256):
        c = _case(rng, m)
        got = _kernel(c)
        want = numpy_scores(**c)
        for name, g, w in zip(("score", "uncached", "wait", "ttft"), got, want):
            assert _same_bits(g, np.asarray(w, dtype=g.dtype)), (name, seed, m, g[:4], np.asarray(w)[:4])


def test_an_infinite_load_cost_gives_the_same_nan_as_numpy():
    """A tier whose load is impossible (infinite cost) makes 0 tier tokens x inf = NaN in numpy; the
    kernel must not hide it, since `best` sends NaN scores to the full ordering."""
    c = _case(np.random.default_rng(7), 8)
    c["has_host"] = True
    c["cost"] = (*c["cost"][:2], np.inf, *c["cost"][3:])
    got = _kernel(c)[0]
    with np.errstate(invalid="ignore"):  # the NaN is the point: numpy need not warn of it
        want = numpy_scores(**c)[0]
    assert np.isnan(want).any()
    assert _same_bits(got, want)


@pytest.mark.parametrize("seed", range(20))
def test_lowest_finds_the_first_minimum_and_how_many_tie(seed):
    rng = np.random.default_rng(seed)
    score = np.round(rng.uniform(0, 1, int(rng.integers(1, 50))), 1)
    first, count = lowest(score)
    ties = np.flatnonzero(score == score.min())
    assert (first, count) == (ties[0], len(ties))
    score[int(rng.integers(len(score)))] = np.nan
    assert lowest(score) == (-1, 0)


def test_where_numba_can_cache_nowhere_the_kernel_compiles_per_process(monkeypatch):
    """A read-only install without a writable home: numba refuses `cache=True` at import; the module must
    still load (compiling in the process) and score the same."""
    import importlib.util

    import numba

    import kvmesh.policies.score_kernel as installed

    real = numba.njit

    def refusing(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", refusing)
    spec = importlib.util.spec_from_file_location("score_kernel_uncached", installed.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    c = _case(np.random.default_rng(3), 16)
    got = fresh.replica_scores(*_kernel_args(c))
    want = installed.replica_scores(*_kernel_args(c))
    assert all(_same_bits(g, w) for g, w in zip(got, want))

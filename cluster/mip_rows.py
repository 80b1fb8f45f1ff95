"""A mixed-integer program for HiGHS, built row by row: the plumbing the placement proofs share
(`exact_placement`, `tier_reach`), so each module states only its model."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np


class MipRows:
    """Constraint rows `lo <= sum(val * x[idx]) <= hi`, then one solve. `inf` is HiGHS's infinity."""

    def __init__(self) -> None:
        import highspy

        self._highspy = highspy
        self.inf = highspy.kHighsInf
        self._idx: list[np.ndarray] = []
        self._val: list[np.ndarray] = []
        self._lo: list[float] = []
        self._hi: list[float] = []

    def add(self, idx, val, lo: float, hi: float) -> None:
        self._idx.append(np.asarray(idx, dtype=np.int32))
        self._val.append(np.asarray(val, dtype=np.float64))
        self._lo.append(lo)
        self._hi.append(hi)

    def solve(self, cost, col_lower, col_upper, integers: int, time_limit_s: float, first_solution: bool):
        """Minimise `cost` over the columns (the first `integers` of them integer) within `time_limit_s` on
        one thread; with `first_solution`, stop at the first feasible one. Returns the HiGHS solver."""
        h = self._highspy
        lp = h.HighsLp()
        lp.num_col_ = len(cost)
        lp.num_row_ = len(self._lo)
        lp.col_cost_ = np.asarray(cost, dtype=np.float64)
        lp.col_lower_ = np.asarray(col_lower, dtype=np.float64)
        lp.col_upper_ = np.asarray(col_upper, dtype=np.float64)
        lp.row_lower_ = np.asarray(self._lo)
        lp.row_upper_ = np.asarray(self._hi)
        lp.a_matrix_.format_ = h.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum([len(i) for i in self._idx])]).astype(np.int32)
        lp.a_matrix_.index_ = np.concatenate(self._idx)
        lp.a_matrix_.value_ = np.concatenate(self._val)
        lp.integrality_ = [h.HighsVarType.kInteger] * integers + [h.HighsVarType.kContinuous] * (len(cost) - integers)
        with stdout_muted():  # HiGHS prints its banner from C++ when the first solver is made
            solver = h.Highs()
        solver.setOptionValue("output_flag", False)
        solver.setOptionValue("time_limit", float(time_limit_s))
        solver.setOptionValue("threads", 1)
        if first_solution:
            solver.setOptionValue("mip_max_improving_sols", 1)
        solver.passModel(lp)
        solver.run()
        return solver


@contextlib.contextmanager
def stdout_muted():
    """Send file descriptor 1 to /dev/null for the block: output written by C code goes nowhere, not
    only Python's (`sys.stdout` is flushed first so nothing already printed is lost)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)

"""One percentile for every report: the simulator's, the replay client's, the sweep's and the benchmarks'
TTFT and timing figures use the same rule, so a live p90 and a simulated p90 mean the same thing."""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank: the ceil(q * n)-th smallest value (the smallest for q = 0).

    A value that occurred, never an interpolation between two; `sorted_values` must be ascending."""
    if not sorted_values:
        raise ValueError("no values")
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]

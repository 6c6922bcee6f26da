"""Pure statistics for interleaved benchmarks: medians, quartiles, per-round
ratios and overlap efficiency. No torch, no timing; unit tested."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["median", "quantile", "iqr", "per_round_ratios", "ratio_summary", "overlap_efficiency"]


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method); NaN for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q} must lie in [0, 1]: it is the fraction of values below the result; "
                         "pass 0.25 for the first quartile.")
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def iqr(values: Sequence[float]) -> tuple[float, float]:
    """(first quartile, third quartile)."""
    return quantile(values, 0.25), quantile(values, 0.75)


def per_round_ratios(times: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """``times[r] / baseline[r]`` for each round ``r`` (both measured in the same round)."""
    if len(times) != len(baseline):
        raise ValueError(
            f"per_round_ratios needs one time per round for both modes, got {len(times)} and "
            f"{len(baseline)}; pass the same rounds for both."
        )
    return [t / b for t, b in zip(times, baseline) if b > 0]


def ratio_summary(times: Sequence[float], baseline: Sequence[float]) -> tuple[float, float, float]:
    """(median, q1, q3) of the per-round ratios ``times / baseline``."""
    ratios = per_round_ratios(times, baseline)
    q1, q3 = iqr(ratios)
    return median(ratios), q1, q3


def overlap_efficiency(compute: float, comm: float, step: float) -> float:
    """``(compute + comm - step) / min(compute, comm)``: 1.0 hides all the shorter
    of the two, 0.0 runs them back to back. NaN when there is nothing to overlap."""
    shorter = min(compute, comm)
    if not shorter > 0:
        return math.nan
    return (compute + comm - step) / shorter

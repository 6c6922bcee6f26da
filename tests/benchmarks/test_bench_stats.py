"""benchmarks.harness.stats: pure functions, no torch."""

import math

import pytest

from benchmarks.harness.stats import iqr, median, overlap_efficiency, per_round_ratios, quantile, ratio_summary


def test_median_odd_even_and_empty():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    assert math.isnan(median([]))


def test_quantile_matches_linear_interpolation():
    xs = [1, 2, 3, 4, 5]
    assert quantile(xs, 0.0) == 1 and quantile(xs, 1.0) == 5
    assert quantile(xs, 0.25) == 2 and quantile(xs, 0.75) == 4
    assert quantile([10, 20], 0.25) == pytest.approx(12.5)
    assert iqr([1, 2, 3, 4]) == (pytest.approx(1.75), pytest.approx(3.25))


def test_quantile_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        quantile([1.0], 1.5)


def test_ratios_are_per_round_not_ratio_of_medians():
    # The noise moves both modes together round by round; per-round ratios cancel it.
    base = [100, 300, 200]
    mode = [90, 270, 180]
    assert per_round_ratios(mode, base) == pytest.approx([0.9, 0.9, 0.9])
    med, q1, q3 = ratio_summary(mode, base)
    assert (med, q1, q3) == (pytest.approx(0.9), pytest.approx(0.9), pytest.approx(0.9))


def test_ratios_need_the_same_rounds():
    with pytest.raises(ValueError, match="one time per round"):
        per_round_ratios([1, 2], [1])


def test_overlap_efficiency_limits():
    assert overlap_efficiency(100, 40, 140) == 0.0  # back to back
    assert overlap_efficiency(100, 40, 100) == 1.0  # comm fully hidden
    assert overlap_efficiency(100, 40, 120) == pytest.approx(0.5)
    assert math.isnan(overlap_efficiency(100, 0, 100))  # nothing to overlap

"""The under_18 / under_21 bands model_build.age_calibration chooses (fit_bands), on made-up estimates."""

from __future__ import annotations

import numpy as np

from model_build.age_calibration import ADULT_CUT_MARGIN, fit_bands


def _calib(young_adults: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Children 5-17 estimated up to 28, 18-20s at the given estimates, adults 21-60 from 20 up."""
    rng = np.random.default_rng(7)
    children = rng.uniform(5, 27, 300)
    children[0] = 28.0
    adults = rng.uniform(20, 60, 400)
    corrected = np.concatenate([children, young_adults, adults])
    ages = np.concatenate(
        [
            rng.integers(5, 18, len(children)),
            rng.integers(18, 21, len(young_adults)),
            rng.integers(21, 61, len(adults)),
        ]
    )
    return corrected, ages


def test_no_child_is_cleared_by_either_flag() -> None:
    corrected, ages = _calib(list(np.linspace(15, 25, 200)))
    bands, checks = fit_bands(corrected, ages)
    assert bands["under_18_adult_from"] == 28.0 + ADULT_CUT_MARGIN
    assert checks["oldest_estimate_under_18"] == 28.0
    children = corrected[ages < 18]
    assert (children < bands["under_18_adult_from"]).all()
    assert (children < bands["under_21_adult_from"]).all()


def test_one_old_looking_18_to_20_does_not_set_under_21s_cut() -> None:
    # One 20-year-old at 40 among 200: clearing him is within the 1% allowed, so under_21's 0 band starts
    # where under_18's does instead of above 40.
    young = [*np.linspace(15, 25, 199), 40.0]
    corrected, ages = _calib(young)
    bands, checks = fit_bands(corrected, ages)
    assert bands["under_21_adult_from"] == bands["under_18_adult_from"] == 29.0
    assert checks["highest_estimates_18_to_20"] == [40.0, 25.0, round(25 - 10 / 198, 3)]


def test_under_21s_cut_rises_above_all_but_1_percent_of_18_to_20s() -> None:
    # Five 18-20s look 30-34 (2.5% of 200): the cut leaves at most two of them (1%) in the 0 band.
    young = [*np.linspace(15, 25, 195), 30.0, 31.0, 32.0, 33.0, 34.0]
    corrected, ages = _calib(young)
    bands, _ = fit_bands(corrected, ages)
    assert bands["under_21_adult_from"] == 32.0 + ADULT_CUT_MARGIN
    cleared = sum(value >= bands["under_21_adult_from"] for value in young)
    assert cleared <= 0.01 * len(young)

"""The calibrated score mapping of face model v2 and the gallery-size default."""

from __future__ import annotations

import math

import pytest

from models.calibration import FaceScoreCalibration


@pytest.fixture(scope="module")
def calibration() -> FaceScoreCalibration:
    return FaceScoreCalibration.load()


def test_score_is_minus_log10_fmr_over_ten(calibration: FaceScoreCalibration) -> None:
    for cosine, log10_fmr in zip(calibration.cosines, calibration.log10_fmr, strict=True):
        assert calibration.score(cosine) == pytest.approx(min(1.0, -log10_fmr / 10), abs=1e-9)
    assert calibration.score(-1.0) == 0.0
    assert calibration.score(1.0) == 1.0


def test_scores_are_monotone_and_invertible(calibration: FaceScoreCalibration) -> None:
    cosines = [c / 200 for c in range(100, 200)]
    scores = [calibration.score(c) for c in cosines]
    assert scores == sorted(scores)
    for score in (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95):
        assert calibration.score(calibration.cosine_for_score(score)) == pytest.approx(score, abs=1e-9)


def test_gallery_default_holds_fpir_at_one_percent() -> None:
    for n in (1, 10, 1000, 10**6):
        score = FaceScoreCalibration.min_score_for_gallery(n)
        fmr = FaceScoreCalibration.fmr_for_score(score)
        fpir = 1 - (1 - fmr) ** n
        assert fpir == pytest.approx(0.01, rel=1e-6)
    # A larger gallery needs a higher bar; an empty gallery is treated as one face.
    assert FaceScoreCalibration.min_score_for_gallery(0) == FaceScoreCalibration.min_score_for_gallery(1)
    assert FaceScoreCalibration.min_score_for_gallery(1000) == pytest.approx(0.5, abs=1e-3)
    assert FaceScoreCalibration.min_score_for_gallery(10**6) > FaceScoreCalibration.min_score_for_gallery(
        1000
    )
    assert math.isclose(FaceScoreCalibration.min_score_for_gallery(10**12), 1.0, abs_tol=0.05)


def test_the_extrapolated_tail_is_no_steeper_than_the_measured_one(calibration: FaceScoreCalibration) -> None:
    """Conservative: measured, log10 FMR falls ever faster as the cosine grows (a roughly Gaussian bulk);
    past the last measured knot (FMR 1e-5) the table continues at no more than the slope measured
    between FMR 1e-3 and 1e-5, so it overstates the FMR of rarer pairs rather than understating it."""
    cosines, logs = calibration.cosines, calibration.log10_fmr

    def at(log10_fmr: float) -> int:
        return next(i for i, v in enumerate(logs) if v <= log10_fmr + 1e-9)

    def slope(i: int, j: int) -> float:
        return (logs[j] - logs[i]) / (cosines[j] - cosines[i])

    bulk, tail_measured = slope(at(-1.0), at(-3.0)), slope(at(-3.0), at(-5.0))
    assert tail_measured < bulk  # steepening
    assert slope(at(-5.0), len(logs) - 1) >= tail_measured - 1e-6

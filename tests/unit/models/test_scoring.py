from __future__ import annotations

import math

import numpy as np
import pytest

from models.scoring import (
    DEFAULT_MATCH_DISTANCE,
    DEFAULT_MIN_SCORE,
    SCORE_SCALE,
    distance_from_score,
    score_from_distance,
)


def test_default_threshold_maps_to_default_min_score() -> None:
    assert score_from_distance(DEFAULT_MATCH_DISTANCE) == pytest.approx(DEFAULT_MIN_SCORE, abs=1e-12)
    assert distance_from_score(DEFAULT_MIN_SCORE) == pytest.approx(DEFAULT_MATCH_DISTANCE, abs=1e-12)


@pytest.mark.parametrize(
    ("distance", "score"),
    [(0.40, 0.982), (0.50, 0.881), (0.55, 0.731), (0.65, 0.269), (0.70, 0.119), (0.80, 0.018)],
)
def test_documented_points(distance: float, score: float) -> None:
    # The module docstring quotes these values; keep the two in step.
    assert score_from_distance(distance) == pytest.approx(score, abs=5e-4)


def test_strictly_decreasing_and_bounded() -> None:
    distances = np.linspace(0.0, 1.5, 3001)
    scores = score_from_distance(distances)
    assert np.all(np.diff(scores) < 0)
    assert scores.min() >= 0.0 and scores.max() <= 1.0
    assert score_from_distance(0.0) > 0.9999
    assert score_from_distance(1e6) == 0.0  # no overflow far from the threshold
    assert 0.0 <= score_from_distance(4.0) < 1e-20


def test_inverse_both_ways() -> None:
    distances = np.linspace(0.0, 1.2, 121)
    np.testing.assert_allclose(distance_from_score(score_from_distance(distances)), distances, atol=1e-9)
    scores = np.linspace(0.001, 0.999, 999)
    np.testing.assert_allclose(score_from_distance(distance_from_score(scores)), scores, atol=1e-12)


def test_score_extremes_invert_to_radius_bounds() -> None:
    assert distance_from_score(1.0) == 0.0
    assert distance_from_score(0.0) == math.inf
    # A score just below 1 inverts to a distance the logistic reaches before 0: clipped, never negative.
    assert distance_from_score(1.0 - 1e-12) == 0.0


def test_custom_threshold_and_scale() -> None:
    assert score_from_distance(0.5, threshold=0.5, scale=0.1) == pytest.approx(0.5)
    assert score_from_distance(0.6, threshold=0.5, scale=0.1) == pytest.approx(1 / (1 + math.e))
    assert distance_from_score(0.25, threshold=0.5, scale=SCORE_SCALE) == pytest.approx(
        0.5 + SCORE_SCALE * math.log(3)
    )


def test_types_follow_the_input() -> None:
    assert isinstance(score_from_distance(0.3), float)
    assert isinstance(distance_from_score(0.3), float)
    assert score_from_distance(np.array([0.3, 0.4])).shape == (2,)
    assert distance_from_score(np.array([0.3, 0.4])).shape == (2,)


@pytest.mark.parametrize("distance", [-0.01, math.nan])
def test_rejects_bad_distances(distance: float) -> None:
    with pytest.raises(ValueError):
        score_from_distance(distance)


@pytest.mark.parametrize("score", [-0.01, 1.01, math.nan])
def test_rejects_bad_scores(score: float) -> None:
    with pytest.raises(ValueError):
        distance_from_score(score)


@pytest.mark.parametrize(("threshold", "scale"), [(0.0, 0.05), (0.6, 0.0), (math.inf, 0.05), (0.6, -1.0)])
def test_rejects_bad_parameters(threshold: float, scale: float) -> None:
    with pytest.raises(ValueError):
        score_from_distance(0.5, threshold=threshold, scale=scale)
    with pytest.raises(ValueError):
        distance_from_score(0.5, threshold=threshold, scale=scale)

"""Similarity score in [0, 1] from the Euclidean distance between two dlib face descriptors.

score = 1 / (1 + exp((distance - DEFAULT_MATCH_DISTANCE) / SCORE_SCALE))

A logistic centred at the match threshold: a pair exactly at DEFAULT_MATCH_DISTANCE (0.6, dlib's operating
point) scores 0.5 (DEFAULT_MIN_SCORE), and the score falls by one e-fold of odds every SCORE_SCALE of
distance. With SCORE_SCALE = 0.05: distance 0.40 -> 0.98, 0.50 -> 0.88, 0.55 -> 0.73, 0.65 -> 0.27,
0.70 -> 0.12, 0.80 -> 0.018.

Dev data (`python -m bench.accuracy`: YuNet + calibrated 5-point alignment + the ONNX descriptor, the
largest face of each of the 30 identity photos of 10 people plus all 7 faces of the 2 group photos):
same-person distances 0.255-0.528 (30 pairs), different-person 0.601-1.059 (636 pairs). At the default 0.6
the false-match rate is 0/636 and the false non-match rate 0/30 (rank-1 identification 30/30); but the
closest different pair sits at 0.601 and 3/636 fall under 0.62, while at 0.55 there are still no misses.
In 1:N search the chance that some gallery entry of another person falls under the threshold grows with
the gallery, so deployments with large galleries should ask for a higher score (0.73 is distance 0.55).

The mapping is monotone and strictly decreasing; distance_from_score is its exact inverse and turns a score
threshold into a search radius. Milvus' "L2" metric reports squared distances: square the radius for it.
"""

from __future__ import annotations

import math
from typing import overload

import numpy as np

DEFAULT_MATCH_DISTANCE = 0.6
SCORE_SCALE = 0.05
DEFAULT_MIN_SCORE = 0.5  # score_from_distance(DEFAULT_MATCH_DISTANCE)


def _check_parameters(threshold: float, scale: float) -> None:
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive distance, got {threshold}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive, got {scale}")


@overload
def score_from_distance(distance: float, threshold: float = ..., scale: float = ...) -> float: ...
@overload
def score_from_distance(distance: np.ndarray, threshold: float = ..., scale: float = ...) -> np.ndarray: ...
def score_from_distance(
    distance: float | np.ndarray,
    threshold: float = DEFAULT_MATCH_DISTANCE,
    scale: float = SCORE_SCALE,
) -> float | np.ndarray:
    """Similarity in [0, 1], 0.5 at threshold; distances must be non-negative."""
    _check_parameters(threshold, scale)
    values = np.asarray(distance, dtype=np.float64)
    if np.any(np.isnan(values)) or np.any(values < 0):
        raise ValueError(f"distances must be non-negative numbers, got {distance}")
    # tanh form of the logistic: no overflow in exp for far-apart descriptors.
    scores = 0.5 * (1.0 - np.tanh((values - threshold) / (2.0 * scale)))
    if isinstance(distance, np.ndarray):
        return scores
    return float(scores)


@overload
def distance_from_score(score: float, threshold: float = ..., scale: float = ...) -> float: ...
@overload
def distance_from_score(score: np.ndarray, threshold: float = ..., scale: float = ...) -> np.ndarray: ...
def distance_from_score(
    score: float | np.ndarray,
    threshold: float = DEFAULT_MATCH_DISTANCE,
    scale: float = SCORE_SCALE,
) -> float | np.ndarray:
    """The distance whose score is `score`: pairs at most this far apart score at least `score`.

    Score 1 gives 0 and score 0 gives infinity (every pair qualifies).
    """
    _check_parameters(threshold, scale)
    values = np.asarray(score, dtype=np.float64)
    if np.any(np.isnan(values)) or np.any(values < 0) or np.any(values > 1):
        raise ValueError(f"scores must lie in [0, 1], got {score}")
    with np.errstate(divide="ignore"):
        distances = threshold + scale * (np.log1p(-values) - np.log(values))
    # Scores near 1 invert to slightly negative distances; no pair is closer than 0.
    distances = np.clip(distances, 0.0, np.inf)
    if isinstance(score, np.ndarray):
        return distances
    return float(distances)

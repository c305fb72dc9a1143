"""Face quality (models.types.FaceQuality, re-exported here) from what the pipeline already has: box
size, detector score, the five landmarks and the aligned chip. No extra model.

Measurements (all cheap, computed for every detected face):
- face_size_px: the shorter side of the detector box, in original-image pixels (resolution of the face);
- detector_score: YuNet's confidence;
- sharpness: variance of the Laplacian of the grey 112 px ArcFace-aligned chip (models.chips), so it is
  measured at the descriptor's own scale: blur and upscaled small faces both score low;
- roll_deg: angle of the eye line; yaw: horizontal offset of the nose tip from the middle of the eyes and
  mouth corners, in half eye distances (0 frontal, about +-1 when the nose reaches an eye's column); pitch:
  where the nose tip sits between the eye line (0) and the mouth line (1), about 0.5 for a frontal face.

Three bars: the enrolment bar (a face stored in a gallery is compared with every later probe, so it must be
good) and the looser search bar (a probe below it still searches, but its matches are reported without
certainty; see serve_app.pipelines.processing). Thresholds were chosen on faces-calib measurements:
`python -m bench.identification` (what each bar rejects and its effect on FNIR/FPIR) and its
`--blur-sweep` (sharpness against matching under Gaussian blur); docs/models.md, "Quality gate".

Age has no bar: the measures here (and chip_measures / blockiness) set the width of the age interval
(models.age_policy.AgeWidthMap), calibrated by `python -m bench.age --calibrate-interval` (docs/age.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import cv2
import numpy as np

from models.chips import align_chip
from models.quality_bars import (
    DEFAULT_QUALITY_THRESHOLDS,
    Pose,
    QualityBar,
    QualityThresholds,
    bar_failures,
)
from models.types import DetectedFace, FaceQuality

__all__ = [
    "DEFAULT_QUALITY_THRESHOLDS",
    "ChipMeasures",
    "FaceQuality",
    "Pose",
    "QualityBar",
    "QualityThresholds",
    "assess_image_faces",
    "assess_quality",
    "blockiness",
    "chip_measures",
    "chip_sharpness",
    "judge_quality",
    "pose_from_landmarks",
]


def pose_from_landmarks(landmarks: np.ndarray) -> Pose:
    """Yaw / pitch proxies and roll from YuNet's five points (image-left eye, image-right eye, nose,
    image-left and image-right mouth corner)."""
    points = np.asarray(landmarks, dtype=np.float64).reshape(5, 2)
    eye_a, eye_b = points[0], points[1]
    eye_vector = eye_b - eye_a
    eye_distance = float(np.hypot(*eye_vector))
    if eye_distance < 1e-6:
        return Pose(yaw=float("inf"), pitch=float("nan"), roll_deg=0.0)
    roll = math.atan2(eye_vector[1], eye_vector[0])
    # Undo the roll around the eyes' midpoint so yaw and pitch are read along the face's own axes.
    cos, sin = math.cos(-roll), math.sin(-roll)
    rotation = np.asarray([[cos, -sin], [sin, cos]])
    level = (points - (eye_a + eye_b) / 2) @ rotation.T
    eyes_y = (level[0, 1] + level[1, 1]) / 2
    mouth_y = (level[3, 1] + level[4, 1]) / 2
    centre_x = float(np.mean(level[[0, 1, 3, 4], 0]))
    yaw = (level[2, 0] - centre_x) / (eye_distance / 2)
    span = mouth_y - eyes_y
    pitch = (level[2, 1] - eyes_y) / span if abs(span) > 1e-6 else float("nan")
    return Pose(yaw=float(yaw), pitch=float(pitch), roll_deg=math.degrees(roll))


def chip_sharpness(chip: np.ndarray) -> float:
    """Variance of the Laplacian of an aligned uint8 RGB (or grey) chip."""
    grey = chip if chip.ndim == 2 else cv2.cvtColor(chip, cv2.COLOR_RGB2GRAY)
    return float(cv2.Laplacian(grey, cv2.CV_64F).var())


# The face inside the 112 px ArcFace-aligned chip (eyes near rows 51, mouth near row 92): the chip measures
# read this region, not the background the alignment pulls in at the corners.
_FACE_ROWS, _FACE_COLS = slice(24, 104), slice(20, 92)
# Immerkaer's noise kernel (the difference of two Laplacians, blind to linear shading): its mean response is
# the finest-scale texture of the face, pixel noise plus the finest detail.
_TEXTURE_KERNEL = np.asarray([[1, -2, 1], [-2, 4, -2], [1, -2, 1]], dtype=np.float32)


@dataclass(frozen=True)
class ChipMeasures:
    """What a photo's light, noise and blur did to a face, on its aligned chip (models.types.FaceQuality)."""

    brightness: float
    contrast: float
    texture: float


def chip_measures(chip: np.ndarray) -> ChipMeasures:
    """Brightness and contrast of the face (0-1) and its finest-scale texture (Immerkaer's noise estimate,
    grey levels): darkness lowers all three; pixel noise and block artefacts raise the texture; blur, a
    small (upscaled) face and smoothing lower it. Measured on the face region of the aligned chip."""
    grey = chip if chip.ndim == 2 else cv2.cvtColor(chip, cv2.COLOR_RGB2GRAY)
    face = grey[_FACE_ROWS, _FACE_COLS].astype(np.float32)
    response = cv2.filter2D(face, cv2.CV_32F, _TEXTURE_KERNEL)[1:-1, 1:-1]
    return ChipMeasures(
        brightness=float(face.mean()) / 255.0,
        contrast=float(face.std()) / 255.0,
        texture=math.sqrt(math.pi / 2) * float(np.abs(response).mean()) / 6.0,
    )


# JPEG codes 8 x 8 pixel blocks; heavy compression leaves steps along the block grid.
_BLOCK = 8
_MIN_BLOCK_REGION = 4 * _BLOCK


def _grid_ratio(steps: np.ndarray) -> float:
    """steps: mean absolute pixel step per column boundary. How much the strongest of the 8 grid phases
    stands out from the median phase (1 for a photo without blocks)."""
    usable = len(steps) - len(steps) % _BLOCK
    phases = steps[:usable].reshape(-1, _BLOCK).mean(axis=0)
    median = float(np.median(phases))
    return float(phases.max()) / median if median > 1e-6 else 1.0


def blockiness(image: np.ndarray, box: np.ndarray) -> float:
    """JPEG block artefacts in the face's box of the decoded image: the larger of the horizontal and
    vertical grid ratios (_grid_ratio), read at whatever phase the grid has (a photo cropped after
    compression keeps its blocks, shifted). About 1.0-1.2 for a photo saved at usual JPEG qualities;
    NaN when the box holds too few blocks to tell."""
    height, width = image.shape[:2]
    x1, y1, x2, y2 = (float(v) for v in box)
    left, top = max(0, math.floor(x1)), max(0, math.floor(y1))
    right, bottom = min(width, math.ceil(x2)), min(height, math.ceil(y2))
    if right - left < _MIN_BLOCK_REGION or bottom - top < _MIN_BLOCK_REGION:
        return float("nan")
    region = image[top:bottom, left:right]
    grey = (region if region.ndim == 2 else cv2.cvtColor(region, cv2.COLOR_RGB2GRAY)).astype(np.float32)
    across = np.abs(np.diff(grey, axis=1)).mean(axis=0)
    down = np.abs(np.diff(grey, axis=0)).mean(axis=1)
    return max(_grid_ratio(across), _grid_ratio(down))


def judge_quality(
    face_size_px: float,
    detector_score: float,
    sharpness: float,
    pose: Pose,
    thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS,
    measures: ChipMeasures | None = None,
) -> FaceQuality:
    """The two bars applied to measurements already taken (and the chip measures the age rules read)."""
    enrol_failures = bar_failures(thresholds.enrol, face_size_px, detector_score, sharpness, pose)
    search_failures = bar_failures(thresholds.search, face_size_px, detector_score, sharpness, pose)
    return FaceQuality(
        face_size_px=face_size_px,
        detector_score=detector_score,
        sharpness=sharpness,
        yaw=pose.yaw,
        pitch=pose.pitch,
        roll_deg=pose.roll_deg,
        enrol_ok=not enrol_failures and not search_failures,
        search_ok=not search_failures,
        reasons=tuple(dict.fromkeys([*enrol_failures, *search_failures])),
        **(dataclasses.asdict(measures) if measures is not None else {}),
    )


def assess_quality(
    detection: DetectedFace,
    chip: np.ndarray,
    thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS,
    image: np.ndarray | None = None,
) -> FaceQuality:
    """Quality of one face from its detection and its 112 px aligned chip (models.chips.align_chip); the
    decoded image, when given, for the face's JPEG blockiness (NaN without it)."""
    x1, y1, x2, y2 = (float(v) for v in detection.box)
    size = max(0.0, min(x2 - x1, y2 - y1))
    pose = pose_from_landmarks(detection.landmarks)
    quality = judge_quality(
        size, float(detection.score), chip_sharpness(chip), pose, thresholds, chip_measures(chip)
    )
    if image is None:
        return quality
    return dataclasses.replace(quality, blockiness=blockiness(image, detection.box))


def assess_image_faces(
    rgb: np.ndarray,
    detections: list[DetectedFace],
    thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS,
) -> list[FaceQuality]:
    """Quality of every face of one RGB image (cuts its own chips; use assess_quality to reuse chips)."""
    return [assess_quality(face, align_chip(rgb, face.landmarks), thresholds, rgb) for face in detections]

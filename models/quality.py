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

The age bar (models.quality_bars.AGE_QUALITY_BAR, applied by models.age_policy) is separate: it was chosen
on faces-wild and faces-calib by what predicts a wrong age estimate (`python -m bench.age` prints what each
check refuses), not by matching.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from models.chips import align_chip
from models.quality_bars import (
    AGE_QUALITY_BAR,
    DEFAULT_QUALITY_THRESHOLDS,
    Pose,
    QualityBar,
    QualityThresholds,
    age_quality_failures,
    bar_failures,
)
from models.types import DetectedFace, FaceQuality

__all__ = [
    "AGE_QUALITY_BAR",
    "DEFAULT_QUALITY_THRESHOLDS",
    "FaceQuality",
    "Pose",
    "QualityBar",
    "QualityThresholds",
    "age_quality_failures",
    "assess_image_faces",
    "assess_quality",
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


def judge_quality(
    face_size_px: float,
    detector_score: float,
    sharpness: float,
    pose: Pose,
    thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS,
) -> FaceQuality:
    """The two bars applied to measurements already taken."""
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
    )


def assess_quality(
    detection: DetectedFace,
    chip: np.ndarray,
    thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS,
) -> FaceQuality:
    """Quality of one face from its detection and its 112 px aligned chip (models.chips.align_chip)."""
    x1, y1, x2, y2 = (float(v) for v in detection.box)
    size = max(0.0, min(x2 - x1, y2 - y1))
    pose = pose_from_landmarks(detection.landmarks)
    return judge_quality(size, float(detection.score), chip_sharpness(chip), pose, thresholds)


def assess_image_faces(
    rgb: np.ndarray,
    detections: list[DetectedFace],
    thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS,
) -> list[FaceQuality]:
    """Quality of every face of one RGB image (cuts its own chips; use assess_quality to reuse chips)."""
    return [assess_quality(face, align_chip(rgb, face.landmarks), thresholds) for face in detections]

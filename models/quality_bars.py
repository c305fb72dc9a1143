"""Quality bars and the checks against them, on measurements already taken (models.types.FaceQuality).
Plain Python: a process that loads no model library can judge measurements it was sent."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QualityBar:
    """Minimums/maximums a face must meet; each failed check adds its reason code."""

    min_face_size_px: float
    min_detector_score: float
    min_sharpness: float
    max_abs_yaw: float
    pitch_range: tuple[float, float]
    max_abs_roll_deg: float


@dataclass(frozen=True)
class QualityThresholds:
    enrol: QualityBar = QualityBar(
        min_face_size_px=60.0,
        min_detector_score=0.85,
        min_sharpness=20.0,
        max_abs_yaw=0.8,
        pitch_range=(0.25, 0.8),
        max_abs_roll_deg=40.0,
    )
    search: QualityBar = QualityBar(
        min_face_size_px=32.0,
        min_detector_score=0.75,
        min_sharpness=10.0,
        max_abs_yaw=1.0,
        pitch_range=(0.15, 0.9),
        max_abs_roll_deg=60.0,
    )


DEFAULT_QUALITY_THRESHOLDS = QualityThresholds()


@dataclass(frozen=True)
class Pose:
    yaw: float
    pitch: float
    roll_deg: float


def bar_failures(bar: QualityBar, size: float, score: float, sharpness: float, pose: Pose) -> list[str]:
    reasons = []
    if size < bar.min_face_size_px:
        reasons.append("small_face")
    if score < bar.min_detector_score:
        reasons.append("low_detector_score")
    if sharpness < bar.min_sharpness:
        reasons.append("blurry")
    low, high = bar.pitch_range
    frontal = (
        math.isfinite(pose.yaw)
        and abs(pose.yaw) <= bar.max_abs_yaw
        and low <= pose.pitch <= high  # NaN compares False: not frontal
        and abs(pose.roll_deg) <= bar.max_abs_roll_deg
    )
    if not frontal:
        reasons.append("extreme_pose")
    return reasons

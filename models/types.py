"""Plain results passed between model runners and to callers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Stored next to every vector, and part of the Milvus collection's name, so vectors of a different model
# (v1: "dlib_resnet_v1", 128-d dlib descriptors) are never compared with these.
MODEL_VERSION = "face_v2_dlib_sface"
FUSED_DIM = 256  # 128 dlib + 128 SFace: the fused vector models.embedder produces


@dataclass(frozen=True)
class DetectedFace:
    """One face in original-image pixel coordinates."""

    box: np.ndarray  # float32 [4]: x1, y1, x2, y2
    landmarks: np.ndarray  # float32 [5, 2]: YuNet order (right eye, left eye, nose, right/left mouth corner)
    score: float

    @property
    def area(self) -> float:
        return float(max(0.0, self.box[2] - self.box[0]) * max(0.0, self.box[3] - self.box[1]))


@dataclass(frozen=True)
class AgeEstimate:
    """What the age model says of one face. The under_18 / under_21 flags the service reports are decided
    from it, and from the photo's other faces and quality, by models.age_policy (AgeDecision)."""

    age: int  # point estimate in years (rounded expectation)
    expected_age: float
    p_under_18: float  # from the predicted distribution
    p_under_21: float


@dataclass(frozen=True)
class FaceQuality:
    """Measured quality of one face and the two gates (computed in models.quality)."""

    face_size_px: float
    detector_score: float
    sharpness: float
    yaw: float
    pitch: float
    roll_deg: float
    enrol_ok: bool  # meets the enrolment bar (implies search_ok)
    search_ok: bool  # meets the search bar
    reasons: tuple[str, ...]  # why the enrolment bar was missed (empty when enrol_ok), stable codes
    # What the age interval's width reads (models.quality.chip_measures), on the same aligned chip; NaN:
    # not measured, which the age rules treat as a face they cannot vouch for.
    brightness: float = float("nan")  # mean grey level of the face, 0-1
    contrast: float = float("nan")  # standard deviation of the grey level, 0-1
    texture: float = float("nan")  # finest-scale texture (grey levels): pixel noise raises it, blur lowers it
    blockiness: float = float("nan")  # JPEG block artefacts in the face's box (1: none)


@dataclass(frozen=True)
class AnalyzedFace:
    detection: DetectedFace
    embedding: np.ndarray | None  # float32 [D], the face descriptor of models.embedder.MODEL_VERSION
    age: AgeEstimate | None
    quality: FaceQuality | None = None  # filled by the analyzer for every detected face


# Face choice needs no model: the API side (which must not load model libraries) uses these too.
def subject_index(faces: Sequence[DetectedFace]) -> int | None:
    """Index of the largest box (the first of equals): the face whose age the service reports."""
    if not faces:
        return None
    return max(range(len(faces)), key=lambda i: faces[i].area)


def largest_face(faces: Sequence[AnalyzedFace]) -> AnalyzedFace | None:
    """The face with the largest box (the first of equals), or None; the service's probe face."""
    return max(faces, key=lambda face: face.detection.area, default=None)

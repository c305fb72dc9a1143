"""The outcomes of finished transactions, as the pipelines produce and the stores persist them. They hold
what was found, not how the interface spells it: the API renders the wire format (the interface's match
triples, proof URLs) from these alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QualityReport:
    """The measurements of a face that missed a quality bar (an extension of the interface)."""

    reasons: tuple[str, ...]
    face_size_px: float
    detector_score: float
    sharpness: float
    yaw: float
    pitch: float
    roll_deg: float


@dataclass(frozen=True)
class FaceMatch:
    face_id: str
    score: float  # calibrated 0..1 (models.calibration), capped for a low-quality probe
    client_reference: str  # "" when the enrolled face has none


@dataclass(frozen=True)
class FaceSearchOutcome:
    is_face_found: bool
    matches: tuple[FaceMatch, ...] = ()  # best first
    # Present when the probe missed the search bar (searched at a stricter rate, scores capped).
    probe_quality: QualityReport | None = None
    # The probe, when enrolment was asked for and it missed the enrolment bar.
    unindexed_faces: tuple[QualityReport, ...] = ()
    enrolled: bool = False  # whether this transaction's face is now in the gallery


@dataclass(frozen=True)
class AgeDecisionReport:
    """Why under_18 or under_21 is 50 (an extension of the interface; models.age_policy)."""

    reason: str  # uncertain_age | face_quality | another_face
    quality: QualityReport | None = None  # the subject's measurements, when reason is face_quality


@dataclass(frozen=True)
class AgeEstimationOutcome:
    age: int | None  # None: no face, or no age the policy stands behind
    under_18: int | None  # 0, 50 or 100 (models.age_policy)
    under_21: int | None
    unindexed_faces: tuple[QualityReport, ...] = ()
    enrolled: bool = False
    age_decision: AgeDecisionReport | None = None  # present exactly when a flag is 50


Outcome = FaceSearchOutcome | AgeEstimationOutcome

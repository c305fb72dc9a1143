"""Safety rules for the reported under_18 / under_21 flags, on top of the calibrated bands (models.age_v2),
and the reason a flag is 50.

A 0 ("certainly not a minor") is the one answer that can do harm, so it is withheld when the estimate might
not be the subject's or might not be worth much. The rules were chosen on faces-wild and faces-calib with
`python -m bench.age` (docs/age.md):

- face_quality: the subject (the largest face) misses the age quality bar (models.quality.AGE_QUALITY_BAR,
  not the enrolment bar): both flags are 50, never 0 or 100, because the estimate itself is in doubt;
- another_face: another face of at least OTHER_FACE_AREA_RATIO of the subject's box area could be a minor:
  its own estimate is not in the 0 band, it misses the age bar, or it was not estimated (more than
  MAX_OTHER_FACES such faces). The photo may be about that face (a toddler held by an adult: the adult's
  face is the largest). A 0 becomes 50; 100 and 50 stay. A group of clear adults no longer costs the 0;
- otherwise a 50 comes from the bands themselves: uncertain_age.

The analyzer estimates the faces named by age_faces(), so this module needs only what it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from models.quality_bars import age_quality_failures
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, subject_index

AgeReason = Literal["uncertain_age", "face_quality", "another_face"]

# Another face of at least a quarter of the subject's box area (half its width) may be the person the photo
# is about; on faces-wild, children held by or next to an adult had 0.76-0.97 of the adult's area. Smaller
# faces are background and are not estimated.
OTHER_FACE_AREA_RATIO = 0.25
# At most this many other faces are estimated (largest first): each costs one more age-model input. A face
# beyond them that is large enough counts as a possible minor.
MAX_OTHER_FACES = 4


def age_faces(faces: Sequence[DetectedFace]) -> tuple[int, ...]:
    """Indices (detection order) of the faces whose age is estimated: the subject first, then the other
    faces of at least OTHER_FACE_AREA_RATIO of its area, largest first, at most MAX_OTHER_FACES."""
    subject = subject_index(faces)
    if subject is None:
        return ()
    limit = OTHER_FACE_AREA_RATIO * faces[subject].area
    others = sorted(
        (i for i, face in enumerate(faces) if i != subject and face.area >= limit),
        key=lambda i: -faces[i].area,
    )
    return (subject, *others[:MAX_OTHER_FACES])


@dataclass(frozen=True)
class AgeDecision:
    """The subject's estimate with the flags as reported, and why a flag is 50 (None when neither is)."""

    estimate: AgeEstimate
    reason: AgeReason | None
    # The age bar's failed checks (models.quality reason codes) when reason is face_quality.
    quality_reasons: tuple[str, ...] = ()


def _could_be_minor(face: AnalyzedFace, limit: Literal[18, 21]) -> bool:
    if face.age is None or face.quality is None or age_quality_failures(face.quality):
        return True
    return (face.age.under_18 if limit == 18 else face.age.under_21) != 0


def decide_age(faces: Sequence[AnalyzedFace]) -> AgeDecision | None:
    """The decision for an image: the largest face's estimate with the rules applied, or None when there is
    no face or no estimate."""
    if not faces:
        return None
    subject = max(faces, key=lambda face: face.detection.area)  # first of equals, as subject_index
    estimate = subject.age
    if estimate is None:
        return None
    failures = age_quality_failures(subject.quality) if subject.quality is not None else ("unmeasured",)
    if failures:
        flagged = dataclasses.replace(estimate, under_18=50, under_21=50)
        return AgeDecision(flagged, "face_quality", tuple(r for r in failures if r != "unmeasured"))
    limit = OTHER_FACE_AREA_RATIO * subject.detection.area
    others = [face for face in faces if face is not subject and face.detection.area >= limit]
    under_18, under_21 = estimate.under_18, estimate.under_21
    if under_18 == 0 and any(_could_be_minor(face, 18) for face in others):
        under_18 = 50
    if under_21 == 0 and any(_could_be_minor(face, 21) for face in others):
        under_21 = 50
    flagged = dataclasses.replace(estimate, under_18=under_18, under_21=under_21)
    if (under_18, under_21) != (estimate.under_18, estimate.under_21):
        return AgeDecision(flagged, "another_face")
    return AgeDecision(flagged, "uncertain_age" if 50 in (under_18, under_21) else None)


def subject_age(faces: Sequence[AnalyzedFace]) -> AgeEstimate | None:
    """The age to report for an image (decide_age's estimate), or None."""
    decision = decide_age(faces)
    return decision.estimate if decision is not None else None

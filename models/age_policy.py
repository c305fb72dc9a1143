"""Safety rules for the reported under_18 / under_21 flags, on top of the calibrated bands (models.age_v2).

A 0 ("certainly not a minor") is the one answer that can do harm, so it is withheld (reported as 50) when
the estimate might not be the subject's or might not be worth much:

- several faces of comparable size: another face's box has at least COMPARABLE_AREA_RATIO of the subject's
  (the largest face's) area, i.e. at least half its width. Then "the largest face" may be the wrong person:
  on wild photos the worst child estimates came from an adult's face picked as the subject;
- the subject's face fails the quality gate (models.quality, the enrolment bar: small, blurred, turned
  away or uncertain faces), where the model's error grows.

100 and 50 are never lowered. The rules need only what the analyzer already returns for every face.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from models.types import AgeEstimate, AnalyzedFace, DetectedFace

# Another face of at least a quarter of the subject's box area (half its width) counts as comparable.
# Background faces in a portrait are far smaller; two people side by side, or a parent and child, are not.
COMPARABLE_AREA_RATIO = 0.25


def several_comparable_faces(
    subject: DetectedFace, faces: Sequence[DetectedFace], ratio: float = COMPARABLE_AREA_RATIO
) -> bool:
    """True when a face other than the subject has at least `ratio` of the subject's box area."""
    return any(face is not subject and face.area >= ratio * subject.area for face in faces)


def guarded(estimate: AgeEstimate, *, comparable_faces: bool, subject_quality_ok: bool) -> AgeEstimate:
    """The estimate with each 0 flag raised to 50 when a safety rule applies; unchanged otherwise."""
    if subject_quality_ok and not comparable_faces:
        return estimate
    return dataclasses.replace(
        estimate,
        under_18=estimate.under_18 or 50,
        under_21=estimate.under_21 or 50,
    )


def subject_quality_ok(face: AnalyzedFace) -> bool:
    """The subject passes the quality gate (the enrolment bar); an unmeasured face does not."""
    return face.quality is not None and face.quality.enrol_ok


def subject_age(faces: Sequence[AnalyzedFace]) -> AgeEstimate | None:
    """The age to report for an image: the largest face's estimate with the safety rules applied, or None
    when there is no face or no estimate."""
    if not faces:
        return None
    subject = max(faces, key=lambda face: face.detection.area)  # first of equals, as analyzer.largest_face
    if subject.age is None:
        return None
    return guarded(
        subject.age,
        comparable_faces=several_comparable_faces(subject.detection, [face.detection for face in faces]),
        subject_quality_ok=subject_quality_ok(subject),
    )

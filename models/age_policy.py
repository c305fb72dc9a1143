"""The reported under_18 / under_21 flags: one calibrated interval per flag, and the reason a flag is 50.

For each limit L (18, 21) the subject's corrected estimate E (models.age_v2) gets an interval

    [E - q_clear(L) * w,  E + q_minor(L) * w]

where w is the width the face's measured quality calls for (AgeWidthMap: 1 for a clean, sharp, frontal,
well-lit face, growing as the photo gets darker, flatter, noisier, blurrier or smaller, the detector less
sure or the head more turned) and the q are split-conformal quantiles calibrated per limit on the people
of the calibration split (`python -m bench.age --calibrate-interval`, models/age_interval.json):

- q_clear(L) from the people under L: at most `minor_cleared_rate` of them (default 1 in 200) have
  (E - L) / w above it, so the flag is 0 ("not under the limit") only when the lower end is above L;
- q_minor(L) from the people at or over L: the flag is 100 only when the upper end is below L, which at most
  `adult_flagged_rate` of them reach (default 1 in 100);
- otherwise 50.

A face the width map cannot vouch for (a measurement missing, worse than any calibration photo in some
respect, or one the detector is less sure of than the enrolment bar asks) has an unbounded interval: 50
for both flags. The comparable-face rule stays: another face of at
least OTHER_FACE_AREA_RATIO of the subject's box area whose own interval does not clear the limit (or that
was not estimated) keeps that flag off 0, since the photo may be about it (a toddler held up by an adult
whose face is the largest).

Why a 50 (AgeDecision.reason): another_face when that rule withheld a 0; face_quality when the face's
quality widened the interval across the limit (a clean photo of the same estimate would have had its
answer), with the measures that did it; uncertain_age when even a clean photo's interval straddles it.

The analyzer estimates the faces named by age_faces(), so this module needs only what it returns; it is
plain Python (the API side loads no model library).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from models.quality_bars import DEFAULT_QUALITY_THRESHOLDS
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality, subject_index

AgeReason = Literal["uncertain_age", "face_quality", "another_face"]
LIMITS: tuple[int, int] = (18, 21)

INTERVAL_FILE = Path(__file__).with_name("age_interval.json")
# The configured error rates (settings: FACESEARCH_AGE_MINOR_CLEARED_RATE): people under a limit whose
# flag may be 0, and people at or over it whose flag may be 100.
DEFAULT_MINOR_CLEARED_RATE = 0.005
DEFAULT_ADULT_FLAGGED_RATE = 0.01

# Another face of at least a quarter of the subject's box area (half its width) may be the person the photo
# is about; on faces-wild, children held by or next to an adult had 0.76-0.97 of the adult's area. Smaller
# faces are background and are not estimated.
OTHER_FACE_AREA_RATIO = 0.25
# At most this many other faces are estimated (largest first): each costs one more age-model input. A face
# beyond them that is large enough counts as a possible minor.
MAX_OTHER_FACES = 4

# A face the detector is less sure of than a face it would enrol is no face to clear an age on: its
# estimate can be of a face-like pattern, a painted or masked face (a child estimated at 44 on faces-wild
# was one, at 0.84). Below this the interval is unbounded, whatever the width map's fit.
MIN_DETECTOR_SCORE = DEFAULT_QUALITY_THRESHOLDS.enrol.min_detector_score

# The quality measures the width reads, each turned into a "badness" that is 0 on a good photo and grows
# as the photo gets worse (AgeWidthMap.badness), and the reason code a client sees for it (the codes of
# models.quality where one exists).
QUALITY_TERMS: dict[str, str] = {
    "dark": "dark",
    "flat": "low_contrast",
    "noisy": "noisy",
    "blurry": "blurry",
    "blocky": "compressed",
    "small": "small_face",
    "unsure": "low_detector_score",
    "turned": "extreme_pose",
}


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
class AgeWidthMap:
    """Face quality -> the interval's relative width, exp(sum of weight x badness) (1 on a good photo).

    Each badness is a log-ratio past a reference level (the median calibration photo), so it is 0 on a
    typical good photo and grows without bound as the photo gets worse; the weights are non-negative, so a
    worse photo never gets a narrower interval. `limits` are the largest badness of each term seen in the
    calibration photos (degraded copies included): beyond any of them the width is infinite."""

    references: Mapping[str, float]
    weights: Mapping[str, float]
    limits: Mapping[str, float]

    def __post_init__(self) -> None:
        for table in (self.weights, self.limits):
            if set(table) != set(QUALITY_TERMS):
                raise ValueError(f"the width map needs exactly the terms {sorted(QUALITY_TERMS)}")
        if any(not weight >= 0 for weight in self.weights.values()):
            raise ValueError("the width map's weights must be non-negative (a worse photo is never narrower)")
        needed = {
            "brightness",
            "contrast",
            "texture_low",
            "texture_high",
            "blockiness",
            "face_size_px",
            "detector_score",
            "yaw",
        }
        if set(self.references) != needed or any(not v > 0 for v in self.references.values()):
            raise ValueError(f"the width map needs positive references for {sorted(needed)}")

    def badness(self, quality: FaceQuality) -> dict[str, float] | None:
        """Each term's badness (>= 0), or None when a measurement is missing. Texture is bad both ways:
        below the usual range the face is blurred or upscaled, above it noisy or blocky."""
        ref = self.references
        values = (
            quality.brightness,
            quality.contrast,
            quality.texture,
            quality.blockiness,
            quality.face_size_px,
            quality.detector_score,
            quality.yaw,
        )
        if not all(math.isfinite(v) for v in values):
            return None

        def below(value: float, reference: float) -> float:  # log of how far the value fell below it
            return max(0.0, math.log(reference / max(value, 1e-6)))

        return {
            "dark": below(quality.brightness, ref["brightness"]),
            "flat": below(quality.contrast, ref["contrast"]),
            "noisy": max(0.0, math.log(max(quality.texture, 1e-6) / ref["texture_high"])),
            "blurry": below(quality.texture, ref["texture_low"]),
            "blocky": max(0.0, math.log(quality.blockiness / ref["blockiness"])),
            "small": below(quality.face_size_px, ref["face_size_px"]),
            "unsure": below(quality.detector_score, ref["detector_score"]),
            "turned": max(0.0, abs(quality.yaw) - ref["yaw"]),
        }

    def outside(self, quality: FaceQuality, terms: Mapping[str, float]) -> list[str]:
        """The terms on which the face lies outside what the interval vouches for: beyond the calibration
        photos' range, or (unsure) below MIN_DETECTOR_SCORE."""
        beyond = [name for name in terms if terms[name] > self.limits[name]]
        if quality.detector_score < MIN_DETECTOR_SCORE and "unsure" not in beyond:
            beyond.insert(0, "unsure")
        return beyond

    def width(self, quality: FaceQuality | None) -> float:
        """The relative width (>= 1), infinite for a face outside the calibrated range or unmeasured."""
        terms = self.badness(quality) if quality is not None else None
        if quality is None or terms is None or self.outside(quality, terms):
            return math.inf
        return math.exp(sum(self.weights[name] * value for name, value in terms.items()))

    def worst_terms(self, quality: FaceQuality | None) -> tuple[str, ...]:
        """The reason codes of the terms that widen this face's interval most (those adding at least a
        third of the largest term's share), worst first; unmeasured when a measurement is missing."""
        terms = self.badness(quality) if quality is not None else None
        if quality is None or terms is None:
            return ("unmeasured",)
        shares = {name: self.weights[name] * value for name, value in terms.items()}
        beyond = self.outside(quality, terms)
        top = max(shares.values())
        if not beyond and top <= 0:
            return ()
        ranked = sorted(
            (n for n in shares if shares[n] > 0 and shares[n] >= top / 3), key=lambda n: -shares[n]
        )
        return tuple(QUALITY_TERMS[name] for name in dict.fromkeys([*beyond, *ranked]))


def conformal_quantile(top_scores: Sequence[float], count: int, rate: float) -> float:
    """The split-conformal (1 - rate) quantile of `count` calibration scores, given the largest of them in
    descending order: the k-th smallest with k = ceil((count + 1)(1 - rate)). For a new person exchangeable
    with the calibration people, P(score > q) <= rate. Infinite when count is too small for the rate."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"an error rate must lie in (0, 1), got {rate}")
    k = math.ceil((count + 1) * (1.0 - rate) - 1e-9)
    if k > count:
        return math.inf
    from_top = count - k
    if from_top >= len(top_scores):
        raise ValueError(
            f"rate {rate} needs the {from_top + 1}th largest calibration score; the calibration keeps "
            f"{len(top_scores)}: rerun `python -m bench.age --calibrate-interval`"
        )
    return float(top_scores[from_top])


@dataclass(frozen=True)
class LimitCalibration:
    """The calibration scores for one limit: (E - L) / w of the people under it (clearing scores) and
    (L - E) / w of those at or over it, each as its count and its largest values, descending."""

    limit: int
    under_count: int
    under_top: tuple[float, ...]
    over_count: int
    over_top: tuple[float, ...]


@dataclass(frozen=True)
class AgeInterval:
    low: float
    high: float

    def flag(self, limit: int) -> int:
        # Strictly above: a calibration score equal to the quantile is the calibration person's own.
        if self.low > limit:
            return 0
        if self.high < limit:
            return 100
        return 50


@dataclass(frozen=True)
class AgeIntervalRule:
    """The calibrated intervals for both flags at the configured error rates (models/age_interval.json)."""

    width_map: AgeWidthMap
    calibrations: Mapping[int, LimitCalibration]
    minor_cleared_rate: float = DEFAULT_MINOR_CLEARED_RATE
    adult_flagged_rate: float = DEFAULT_ADULT_FLAGGED_RATE

    def __post_init__(self) -> None:
        if set(self.calibrations) != set(LIMITS):
            raise ValueError(f"the interval rule needs a calibration for each of the limits {LIMITS}")
        for limit in LIMITS:  # fail at start-up, not on the first request, when a rate cannot be met
            c = self.calibrations[limit]
            for rate, count, quantile in (
                (self.minor_cleared_rate, c.under_count, self.clear_quantile(limit)),
                (self.adult_flagged_rate, c.over_count, self.minor_quantile(limit)),
            ):
                if not math.isfinite(quantile):
                    raise ValueError(
                        f"an error rate of {rate:g} for the limit {limit} needs at least "
                        f"{math.ceil(1 / rate - 1)} calibration people on that side; it has {count}"
                    )

    def clear_quantile(self, limit: int) -> float:
        c = self.calibrations[limit]
        return conformal_quantile(c.under_top, c.under_count, self.minor_cleared_rate)

    def minor_quantile(self, limit: int) -> float:
        c = self.calibrations[limit]
        return conformal_quantile(c.over_top, c.over_count, self.adult_flagged_rate)

    def interval(self, limit: int, estimate: float, width: float) -> AgeInterval:
        if not math.isfinite(width):
            return AgeInterval(-math.inf, math.inf)
        return AgeInterval(
            estimate - self.clear_quantile(limit) * width, estimate + self.minor_quantile(limit) * width
        )

    @classmethod
    def load(
        cls,
        path: Path = INTERVAL_FILE,
        minor_cleared_rate: float = DEFAULT_MINOR_CLEARED_RATE,
        adult_flagged_rate: float = DEFAULT_ADULT_FLAGGED_RATE,
    ) -> AgeIntervalRule:
        data = json.loads(path.read_text(encoding="utf-8"))
        width = data["width_map"]
        calibrations = {
            int(limit): LimitCalibration(
                limit=int(limit),
                under_count=int(c["under_count"]),
                under_top=tuple(float(v) for v in c["under_top"]),
                over_count=int(c["over_count"]),
                over_top=tuple(float(v) for v in c["over_top"]),
            )
            for limit, c in data["limits"].items()
        }
        return cls(
            width_map=AgeWidthMap(
                references={k: float(v) for k, v in width["references"].items()},
                weights={k: float(v) for k, v in width["weights"].items()},
                limits={k: float(v) for k, v in width["limits"].items()},
            ),
            calibrations=calibrations,
            minor_cleared_rate=minor_cleared_rate,
            adult_flagged_rate=adult_flagged_rate,
        )


@dataclass(frozen=True)
class AgeDecision:
    """The subject's estimate, the flags as reported, and why a flag is 50 (None when neither is)."""

    estimate: AgeEstimate
    under_18: int  # 0, 50 or 100
    under_21: int
    reason: AgeReason | None
    # The quality terms that widened the interval (reason codes, worst first) when reason is face_quality.
    quality_reasons: tuple[str, ...] = ()
    # The interval for each flag, [low, high] in years (infinite ends when the face cannot be vouched for).
    intervals: Mapping[int, AgeInterval] = dataclasses.field(default_factory=dict)
    width: float = 1.0  # the relative width the face's quality called for (1 on a good photo)


def _face_flags(face: AnalyzedFace, rule: AgeIntervalRule) -> list[int]:
    """A face's own [under_18, under_21] (50, 50 when it was not estimated)."""
    if face.age is None:
        return [50, 50]
    width = rule.width_map.width(face.quality)
    return _consistent([rule.interval(limit, face.age.expected_age, width).flag(limit) for limit in LIMITS])


def _consistent(flags: list[int]) -> list[int]:
    """[under_18, under_21] made consistent: someone not surely 18 is not surely 21, and someone surely
    under 18 is surely under 21."""
    under_18, under_21 = flags
    if under_18 != 0 and under_21 == 0:
        under_21 = 50
    if under_18 == 100:
        under_21 = 100
    return [under_18, under_21]


def decide_age(faces: Sequence[AnalyzedFace], rule: AgeIntervalRule) -> AgeDecision | None:
    """The decision for an image: the largest face's estimate with the flags of its intervals and the
    comparable-face rule, or None when there is no face or no estimate."""
    if not faces:
        return None
    subject = max(faces, key=lambda face: face.detection.area)  # first of equals, as subject_index
    estimate = subject.age
    if estimate is None:
        return None
    width = rule.width_map.width(subject.quality)
    intervals: dict[int, AgeInterval] = {
        limit: rule.interval(limit, estimate.expected_age, width) for limit in LIMITS
    }
    banded = _consistent([intervals[limit].flag(limit) for limit in LIMITS])
    area = OTHER_FACE_AREA_RATIO * subject.detection.area
    others = [face for face in faces if face is not subject and face.detection.area >= area]
    others_flags = [_face_flags(face, rule) for face in others]
    flags = [
        50 if flag == 0 and any(other[j] != 0 for other in others_flags) else flag
        for j, flag in enumerate(banded)
    ]
    reason: AgeReason | None = None
    quality_reasons: tuple[str, ...] = ()
    if flags != banded:
        reason = "another_face"
    elif 50 in flags:
        # Would a clean photo (width 1) with the same estimate have had an answer for a flag that is 50?
        clean = _consistent(
            [rule.interval(limit, estimate.expected_age, 1.0).flag(limit) for limit in LIMITS]
        )
        if any(flag == 50 and ideal != 50 for flag, ideal in zip(flags, clean, strict=True)):
            reason, quality_reasons = "face_quality", rule.width_map.worst_terms(subject.quality)
        else:
            reason = "uncertain_age"
    return AgeDecision(estimate, flags[0], flags[1], reason, quality_reasons, intervals, width)

from __future__ import annotations

import itertools
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from models.age_policy import (
    INTERVAL_FILE,
    LIMITS,
    MAX_OTHER_FACES,
    MIN_DETECTOR_SCORE,
    OTHER_FACE_AREA_RATIO,
    QUALITY_TERMS,
    AgeDecision,
    AgeIntervalRule,
    AgeWidthMap,
    LimitCalibration,
    age_faces,
    conformal_quantile,
    decide_age,
)
from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality
from tests.faces_dev import FacesDev

# A made-up calibration: 399 people on each side of each limit. At the default rate (1 in 200) the clearing
# quantile is the 2nd largest score (k = ceil(400 x 0.995) = 398), here 10.0 for both limits: a clean face
# (width 1) is cleared from E = 28 (under_18) and E = 31 (under_21). The 100 side (1 in 100: the 4th
# largest) is 3.0: 100 when E < 15 (18) or E < 18 (21).
_UNDER_TOP = (12.0, 10.0, 9.0, 8.0, 7.0, 6.0)
_OVER_TOP = (6.0, 5.0, 4.0, 3.0, 2.0, 1.0)
REFERENCES = {
    "brightness": 0.5,
    "contrast": 0.15,
    "texture_low": 1.0,
    "texture_high": 2.0,
    "blockiness": 1.4,
    "face_size_px": 100.0,
    "detector_score": 0.9,
    "yaw": 0.2,
}
WIDTH_MAP = AgeWidthMap(
    references=REFERENCES,
    weights={
        "dark": 0.5,
        "flat": 0.3,
        "noisy": 0.6,
        "blurry": 0.4,
        "blocky": 0.5,
        "small": 0.5,
        "unsure": 2.0,
        "turned": 0.3,
    },
    limits={
        "dark": 2.0,
        "flat": 2.0,
        "noisy": 2.0,
        "blurry": 2.0,
        "blocky": 2.0,
        "small": 1.5,
        "unsure": 0.3,
        "turned": 2.0,
    },
)


def _rule(**rates: float) -> AgeIntervalRule:
    calibrations = {limit: LimitCalibration(limit, 399, _UNDER_TOP, 399, _OVER_TOP) for limit in LIMITS}
    return AgeIntervalRule(WIDTH_MAP, calibrations, **rates)


RULE = _rule()


def _estimate(age: float) -> AgeEstimate:
    return AgeEstimate(age=round(age), expected_age=float(age), p_under_18=0.0, p_under_21=0.0)


ADULT = _estimate(40)


def _detection(side: float, x: float = 0.0) -> DetectedFace:
    return DetectedFace(
        box=np.array([x, 0.0, x + side, side], dtype=np.float32),
        landmarks=np.zeros((5, 2), dtype=np.float32),
        score=0.95,
    )


def _quality(
    size: float = 100.0,
    score: float = 0.95,
    yaw: float = 0.0,
    brightness: float = 0.5,
    contrast: float = 0.15,
    texture: float = 1.5,
    blockiness: float = 1.2,
) -> FaceQuality:
    return FaceQuality(
        face_size_px=size,
        detector_score=score,
        sharpness=100.0,  # the enrolment bars' measure; the age rules do not read it
        yaw=yaw,
        pitch=0.5,
        roll_deg=0.0,
        enrol_ok=False,  # nor the enrolment verdict
        search_ok=False,
        reasons=(),
        brightness=brightness,
        contrast=contrast,
        texture=texture,
        blockiness=blockiness,
    )


def _face(age: AgeEstimate | None, side: float = 100.0, x: float = 0.0, **quality: float) -> AnalyzedFace:
    return AnalyzedFace(_detection(side, x), None, age, _quality(**quality))


def _flags(decision: AgeDecision | None) -> tuple[int, int]:
    assert decision is not None
    return decision.under_18, decision.under_21


def test_age_faces_are_the_subject_then_comparable_faces_largest_first() -> None:
    assert age_faces([]) == ()
    subject = _detection(100.0, x=0)
    half_width = _detection(50.0, x=200)  # exactly a quarter of the area
    assert OTHER_FACE_AREA_RATIO == 0.25
    assert age_faces([half_width, subject, _detection(49.0, x=400)]) == (1, 0)
    # An identical box elsewhere is another face; the first of equals is the subject.
    assert age_faces([subject, _detection(100.0, x=300)]) == (0, 1)
    many = [_detection(60.0 + i, x=100.0 * i) for i in range(MAX_OTHER_FACES + 3)] + [subject]
    chosen = age_faces(many)
    assert chosen[0] == len(many) - 1 and len(chosen) == 1 + MAX_OTHER_FACES
    assert [many[i].area for i in chosen[1:]] == sorted((d.area for d in many[:-1]), reverse=True)[
        :MAX_OTHER_FACES
    ]


def test_the_conformal_quantile_is_the_kth_smallest_score() -> None:
    scores = (12.0, 10.0, 9.0)
    # n = 199, rate 1/200: k = ceil(200 x 0.995) = 199, the largest score.
    assert conformal_quantile(scores, 199, 0.005) == 12.0
    assert conformal_quantile(scores, 399, 0.005) == 10.0  # k = 398 of 399: the 2nd largest
    assert conformal_quantile(scores, 399, 0.0075) == 9.0  # k = 397
    assert conformal_quantile(scores, 150, 0.005) == math.inf  # too few people for 1 in 200
    with pytest.raises(ValueError, match="calibration keeps"):
        conformal_quantile(scores, 399, 0.05)
    with pytest.raises(ValueError, match="error rate"):
        conformal_quantile(scores, 399, 0.0)


def test_a_rate_the_calibration_cannot_support_fails_at_start_up() -> None:
    calibrations = {limit: LimitCalibration(limit, 150, _UNDER_TOP, 399, _OVER_TOP) for limit in LIMITS}
    with pytest.raises(ValueError, match="needs at least 199"):
        AgeIntervalRule(WIDTH_MAP, calibrations)


def test_flags_follow_the_interval_ends() -> None:
    # Clean face, width 1: under_18 is 0 above E = 18 + 10 (strictly: a calibration score equal to the
    # quantile is a calibration person's own), 100 below 18 - 3; under_21 likewise around 21.
    cases = [
        (40.0, (0, 0)),
        (31.1, (0, 0)),
        (31.0, (0, 50)),
        (28.1, (0, 50)),
        (28.0, (50, 50)),
        (17.9, (50, 100)),
        (14.9, (100, 100)),
    ]
    for estimate, flags in cases:
        decision = decide_age([_face(_estimate(estimate))], RULE)
        assert _flags(decision) == flags, estimate
        assert decision is not None and decision.width == pytest.approx(1.0)
        interval = decision.intervals[18]
        assert (interval.low, interval.high) == pytest.approx((estimate - 10.0, estimate + 3.0))
    assert decide_age([], RULE) is None and decide_age([_face(None)], RULE) is None
    adult = decide_age([_face(ADULT)], RULE)
    assert adult is not None and adult.estimate == ADULT and _flags(adult) == (0, 0)  # the estimate as made


def test_a_stricter_rate_widens_the_interval() -> None:
    strict = _rule(minor_cleared_rate=0.0025)  # k = 399 of 399: the largest score, 12
    assert strict.clear_quantile(18) == 12.0 > RULE.clear_quantile(18)
    assert _flags(decide_age([_face(_estimate(29.0))], strict)) == (50, 50)
    assert _flags(decide_age([_face(_estimate(29.0))], RULE)) == (0, 50)


@pytest.mark.parametrize(
    ("measure", "values"),
    [
        ("brightness", (0.5, 0.3, 0.15, 0.08)),
        ("contrast", (0.15, 0.1, 0.05, 0.03)),
        ("texture", (1.5, 0.8, 0.5, 0.3)),  # blurred, upscaled
        ("texture", (1.5, 3.0, 5.0, 12.0)),  # noisy
        ("size", (100.0, 70.0, 45.0, 30.0)),
        ("score", (0.95, 0.85, 0.8, 0.7)),
        ("yaw", (0.0, 0.8, 1.5, 2.5)),
        ("blockiness", (1.2, 1.8, 3.0, 5.0)),
    ],
)
def test_a_worse_photo_never_gets_a_narrower_interval(measure: str, values: tuple[float, ...]) -> None:
    widths = [WIDTH_MAP.width(_quality(**{measure: value})) for value in values]
    assert widths[0] == pytest.approx(1.0)
    assert all(a <= b for a, b in itertools.pairwise(widths)), widths
    assert widths[-1] > widths[0]
    assert math.isinf(widths[-1]) or widths[-1] > 1.5


def test_a_poor_photo_of_an_adult_looking_face_is_not_cleared() -> None:
    # E = 33 clears a clean photo; dark, blurred, small, doubtful or blocky, the interval reaches under 18.
    for measures in (
        {"brightness": 0.15},
        {"texture": 0.3},
        {"size": 40.0},
        {"score": 0.7},
        {"blockiness": 4.5},
    ):
        decision = decide_age([_face(_estimate(33.0), **measures)], RULE)
        assert decision is not None and _flags(decision) == (50, 50), measures
        assert decision.reason == "face_quality" and decision.quality_reasons, measures
        assert decision.width > 1.0


def test_a_face_the_calibration_cannot_vouch_for_gets_50_for_both_flags() -> None:
    for estimate in (60.0, 5.0):
        for measures in ({"brightness": 0.05}, {"score": 0.6}, {"texture": float("nan")}):
            decision = decide_age([_face(_estimate(estimate), **measures)], RULE)
            assert decision is not None and _flags(decision) == (50, 50), (estimate, measures)
            assert decision.reason == "face_quality" and math.isinf(decision.width)
            assert decision.estimate.age == round(estimate)  # the age itself is still reported
    decision = decide_age([_face(ADULT, texture=float("nan"))], RULE)
    assert decision is not None and decision.quality_reasons == ("unmeasured",)
    decision = decide_age([_face(ADULT, brightness=0.05)], RULE)
    assert decision is not None and decision.quality_reasons[0] == "dark"


def test_a_face_the_detector_would_not_enrol_is_never_cleared() -> None:
    # Within the width map's calibrated range (its own reference is 0.9 here), but below the enrolment
    # bar's detector score: a face-like pattern or a painted face looking 44 is no adult to clear.
    assert WIDTH_MAP.limits["unsure"] > math.log(REFERENCES["detector_score"] / 0.84)
    assert MIN_DETECTOR_SCORE > 0.84
    decision = decide_age([_face(_estimate(44.0), score=0.84)], RULE)
    assert decision is not None and _flags(decision) == (50, 50)
    assert decision.reason == "face_quality" and decision.quality_reasons[0] == "low_detector_score"
    assert math.isinf(decision.width)
    cleared = decide_age([_face(_estimate(44.0), score=MIN_DETECTOR_SCORE)], RULE)
    assert cleared is not None and _flags(cleared) == (0, 0)


def test_quality_reasons_name_what_widened_the_interval() -> None:
    decision = decide_age([_face(_estimate(33.0), texture=6.0)], RULE)
    assert decision is not None and decision.reason == "face_quality"
    assert decision.quality_reasons[0] == "noisy"
    assert set(QUALITY_TERMS.values()) >= set(decision.quality_reasons)


def test_uncertain_age_when_even_a_clean_photo_would_straddle_the_limit() -> None:
    decision = decide_age([_face(_estimate(20.0))], RULE)
    assert decision is not None and _flags(decision) == (50, 50) and decision.reason == "uncertain_age"
    # Slightly worse than clean, but a clean photo of E = 20 would not have been decided either.
    decision = decide_age([_face(_estimate(20.0), size=80.0)], RULE)
    assert decision is not None and decision.reason == "uncertain_age"


def test_another_face_withholds_a_0_only_when_it_could_be_a_minor() -> None:
    subject = _face(ADULT)
    cases = [
        (_face(_estimate(17.0), 90.0, x=200), (50, 50), "another_face"),
        (_face(None, 90.0, x=200), (50, 50), "another_face"),  # comparable but not estimated
        (_face(ADULT, 90.0, x=200, texture=0.1), (50, 50), "another_face"),  # too blurred to tell
        (_face(ADULT, 90.0, x=200), (0, 0), None),  # two clear adults
        (_face(_estimate(29.0), 90.0, x=200), (0, 50), "another_face"),  # an adult for 18, not for 21
        (_face(_estimate(17.0), 49.0, x=200), (0, 0), None),  # background: under a quarter of the area
    ]
    for other, flags, reason in cases:
        decision = decide_age([other, subject], RULE)
        assert _flags(decision) == flags, other
        assert decision is not None and decision.reason == reason


def test_a_50_or_100_of_the_subject_is_never_changed_by_other_faces() -> None:
    decision = decide_age([_face(_estimate(17.0)), _face(ADULT, 90.0, x=200)], RULE)
    assert _flags(decision) == (50, 100)
    assert decision is not None and decision.reason == "uncertain_age"
    decision = decide_age([_face(_estimate(8.0)), _face(_estimate(17.0), 90.0, x=200)], RULE)
    assert _flags(decision) == (100, 100)
    assert decision is not None and decision.reason is None


def test_the_committed_calibration_supports_the_default_rate() -> None:
    rule = AgeIntervalRule.load(INTERVAL_FILE)
    for limit in LIMITS:
        calibration = rule.calibrations[limit]
        # 1 in 200 needs at least 199 calibration people under the limit.
        assert calibration.under_count >= 199
        assert math.isfinite(rule.clear_quantile(limit)) and math.isfinite(rule.minor_quantile(limit))


def test_the_flags_never_contradict_each_other() -> None:
    # Someone not surely 18 is not surely 21; someone surely under 18 is surely under 21, whatever the two
    # limits' quantiles say.
    calibrations = {
        18: LimitCalibration(18, 399, (30.0, 20.0), 399, _OVER_TOP),
        21: LimitCalibration(21, 399, (2.0, 1.0), 399, (30.0, 20.0, 10.0, 0.0)),
    }
    rule = AgeIntervalRule(WIDTH_MAP, calibrations)
    for estimate in (10.0, 19.0, 23.0, 30.0, 39.0, 45.0):
        u18, u21 = _flags(decide_age([_face(_estimate(estimate))], rule))
        assert u21 != 0 or u18 == 0, estimate
        assert u18 != 100 or u21 == 100, estimate


# ---------------------------------------------------------------- the rules on real photos (faces-dev)


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


# The committed calibration at the default rate, as the service runs it.
COMMITTED = AgeIntervalRule.load()


@pytest.fixture(scope="module")
def analyzer() -> FaceAnalyzer:
    return load_face_analyzer(ModelConfig(intra_op_threads=1))


def _square(image: np.ndarray, side: int) -> np.ndarray:
    return cv2.resize(image, (side, side), interpolation=cv2.INTER_AREA)


@pytest.fixture(scope="module")
def cleared_adult(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> np.ndarray:
    """A dev age photo of an adult that, alone in the frame, gets under_18 = 0 (resized to 240 px)."""
    for item in faces_dev.of_kind("age"):
        if item.age is None or item.age < 30:
            continue
        image = _square(_pixels(item.path), 240)
        age = decide_age(analyzer.analyze([image])[0], COMMITTED)
        if age is not None and age.under_18 == 0:
            return image
    raise AssertionError("no dev adult of 30+ is cleared on their own: the interval rule is too cautious")


@pytest.fixture(scope="module")
def cleared_adults(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> list[np.ndarray]:
    """Two dev adults of 30+ that are each cleared alone (resized to 240 px)."""
    found = []
    for item in faces_dev.of_kind("age"):
        if item.age is None or item.age < 30:
            continue
        image = _square(_pixels(item.path), 240)
        age = decide_age(analyzer.analyze([image])[0], COMMITTED)
        if age is not None and age.under_18 == 0 and age.under_21 == 0:
            found.append(image)
        if len(found) == 2:
            return found
    raise AssertionError("fewer than two dev adults of 30+ are cleared on their own")


@pytest.fixture(scope="module")
def child(faces_dev: FacesDev) -> np.ndarray:
    young = [item for item in faces_dev.of_kind("age") if item.age is not None and item.age <= 11]
    assert young, "the dev set should hold children"
    return _pixels(min(young, key=lambda item: item.age or 0).path)


def _side_by_side(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    height = max(left.shape[0], right.shape[0])
    canvas = np.full((height + 80, left.shape[1] + right.shape[1] + 120, 3), 200, dtype=np.uint8)
    canvas[40 : 40 + left.shape[0], 40 : 40 + left.shape[1]] = left
    x = 80 + left.shape[1]
    canvas[40 : 40 + right.shape[0], x : x + right.shape[1]] = right
    return canvas


def _held(adult: np.ndarray, child: np.ndarray) -> np.ndarray:
    """As on faces-wild (wild_0025: a toddler held up in the middle, the adult's face larger, at the edge
    and cut by the frame): the child's photo in the centre of the canvas, the adult's at the left edge,
    overlapping it and partly out of the frame."""
    side = adult.shape[0]
    canvas = np.full((side + 120, side + child.shape[1] + 40, 3), 200, dtype=np.uint8)
    canvas[60 : 60 + side, : side - 30] = adult[:, 30:]  # the left 30 px of the adult are out of frame
    x = side - 60  # the child's photo covers the adult's right shoulder
    canvas[100 : 100 + child.shape[0], x : x + child.shape[1]] = child
    return canvas


def _decide(analyzer: FaceAnalyzer, image: np.ndarray) -> tuple[list[AnalyzedFace], AgeDecision]:
    faces = analyzer.analyze([image])[0]
    decision = decide_age(faces, COMMITTED)
    assert decision is not None
    return faces, decision


def test_a_child_held_by_an_adult_gets_no_0(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    faces, decision = _decide(analyzer, _held(cleared_adult, _square(child, 200)))
    assert len(faces) == 2
    subject = max(faces, key=lambda face: face.detection.area)
    other = next(face for face in faces if face is not subject)
    # The adult is the subject and would be cleared; the child's face, estimated too, withholds the 0.
    assert _flags(decide_age([subject], COMMITTED))[0] == 0
    assert other.age is not None and _flags(decide_age([other], COMMITTED))[0] != 0
    assert decision.under_18 == 50 and decision.under_21 == 50
    assert decision.reason == "another_face"


def test_a_second_comparable_face_that_could_be_a_minor_withholds_the_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    # The child's face is a little smaller than the adult's: the adult is the subject, and the answer must
    # not say "adult" when it may be the child the photo is about.
    faces, decision = _decide(analyzer, _side_by_side(cleared_adult, _square(child, 200)))
    assert len(faces) == 2
    assert decision.under_18 != 0 and decision.under_21 != 0
    assert decision.reason == "another_face"


def test_two_adults_side_by_side_are_cleared(
    analyzer: FaceAnalyzer, cleared_adults: list[np.ndarray]
) -> None:
    first, second = cleared_adults
    faces, decision = _decide(analyzer, _side_by_side(first, _square(second, 220)))
    assert len(faces) == 2 and all(face.age is not None for face in faces)  # both were estimated
    assert decision.under_18 == 0 and decision.reason in (None, "uncertain_age")


def test_a_small_background_face_is_not_estimated_and_does_not_withhold_the_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    faces, decision = _decide(analyzer, _side_by_side(cleared_adult, _square(child, 90)))
    subject = max(faces, key=lambda face: face.detection.area)
    others = [face for face in faces if face is not subject]
    assert others and all(f.detection.area < OTHER_FACE_AREA_RATIO * subject.detection.area for f in others)
    assert all(face.age is None for face in others)  # no model time spent on them
    assert decision.under_18 == 0


def test_a_subject_below_the_age_bar_gets_50(analyzer: FaceAnalyzer, cleared_adult: np.ndarray) -> None:
    # Blurred hard enough to miss the age bar; alone in the frame, so only the quality rule applies.
    blurred = cv2.GaussianBlur(cleared_adult, (0, 0), 6)
    faces, decision = _decide(analyzer, blurred)
    assert len(faces) == 1
    assert (decision.under_18, decision.under_21) == (50, 50)
    assert decision.reason == "face_quality" and decision.quality_reasons


def test_dev_group_photos_estimate_every_comparable_face(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    groups = faces_dev.of_kind("group")
    assert groups
    crowded = 0
    for item in groups:
        faces, decision = _decide(analyzer, _pixels(item.path))
        subject = max(faces, key=lambda face: face.detection.area)
        comparable = [
            face
            for face in faces
            if face is not subject and face.detection.area >= OTHER_FACE_AREA_RATIO * subject.detection.area
        ]
        crowded += bool(comparable)
        assert all(face.age is not None for face in comparable[:MAX_OTHER_FACES]), item.path.name
        possible_minor = any(
            face.age is None or _flags(decide_age([face], COMMITTED))[0] != 0 for face in comparable
        )
        if possible_minor:
            assert decision.under_18 != 0, item.path.name
    assert crowded >= 1, "at least one dev group photo should have faces of comparable size"

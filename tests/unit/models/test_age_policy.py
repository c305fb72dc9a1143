from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from models.age_policy import (
    MAX_OTHER_FACES,
    OTHER_FACE_AREA_RATIO,
    AgeDecision,
    age_faces,
    decide_age,
    subject_age,
)
from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.quality_bars import AGE_QUALITY_BAR, DEFAULT_QUALITY_THRESHOLDS
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality
from tests.faces_dev import FacesDev


def _estimate(under_18: int, under_21: int, age: int = 30) -> AgeEstimate:
    return AgeEstimate(
        age=age, expected_age=float(age), p_under_18=0.0, p_under_21=0.0, under_18=under_18, under_21=under_21
    )


ADULT = _estimate(0, 0, 40)
MAYBE_MINOR = _estimate(50, 100, 17)


def _detection(side: float, x: float = 0.0) -> DetectedFace:
    return DetectedFace(
        box=np.array([x, 0.0, x + side, side], dtype=np.float32),
        landmarks=np.zeros((5, 2), dtype=np.float32),
        score=0.95,
    )


def _quality(
    size: float = 100.0, score: float = 0.95, sharpness: float = 100.0, yaw: float = 0.0, roll: float = 0.0
) -> FaceQuality:
    return FaceQuality(
        face_size_px=size,
        detector_score=score,
        sharpness=sharpness,
        yaw=yaw,
        pitch=0.5,
        roll_deg=roll,
        enrol_ok=False,  # the age rules do not read the enrolment verdict
        search_ok=False,
        reasons=(),
    )


def _face(age: AgeEstimate | None, side: float = 100.0, x: float = 0.0, **quality: float) -> AnalyzedFace:
    return AnalyzedFace(_detection(side, x), None, age, _quality(**quality))


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


def test_a_clear_adult_alone_is_cleared_without_a_reason() -> None:
    decision = decide_age([_face(ADULT)])
    assert decision is not None and decision.estimate == ADULT and decision.reason is None
    assert decide_age([]) is None and decide_age([_face(None)]) is None
    assert subject_age([_face(ADULT)]) == ADULT


@pytest.mark.parametrize(
    ("measurements", "reason"),
    [
        ({"size": AGE_QUALITY_BAR.min_face_size_px - 1}, "small_face"),
        ({"score": AGE_QUALITY_BAR.min_detector_score - 0.01}, "low_detector_score"),
        ({"sharpness": AGE_QUALITY_BAR.min_sharpness - 1}, "blurry"),
        ({"yaw": AGE_QUALITY_BAR.max_abs_yaw + 0.1}, "extreme_pose"),
        ({"roll": AGE_QUALITY_BAR.max_abs_roll_deg + 1}, "extreme_pose"),
    ],
)
def test_below_the_age_bar_both_flags_are_50_never_0_or_100(
    measurements: dict[str, float], reason: str
) -> None:
    for estimate in (ADULT, _estimate(100, 100, 8)):
        decision = decide_age([_face(estimate, **measurements)])
        assert decision is not None
        assert (decision.estimate.under_18, decision.estimate.under_21) == (50, 50)
        assert decision.reason == "face_quality" and decision.quality_reasons == (reason,)
        assert decision.estimate.age == estimate.age  # the age itself is still reported


def test_the_age_bar_is_looser_than_the_enrolment_bar_where_age_allows_it() -> None:
    # A turned head that the enrolment bar refuses still gets an age answer: turned heads mostly make the
    # model under-estimate (README "Age estimation").
    turned = DEFAULT_QUALITY_THRESHOLDS.enrol.max_abs_yaw + 0.3
    assert turned <= AGE_QUALITY_BAR.max_abs_yaw
    decision = decide_age([_face(ADULT, yaw=turned)])
    assert decision is not None and decision.estimate.under_18 == 0 and decision.reason is None


def test_another_face_withholds_a_0_only_when_it_could_be_a_minor() -> None:
    subject = _face(ADULT)
    cases = [
        (_face(MAYBE_MINOR, 90.0, x=200), (50, 50), "another_face"),
        (_face(None, 90.0, x=200), (50, 50), "another_face"),  # comparable but not estimated
        (_face(ADULT, 90.0, x=200, sharpness=5.0), (50, 50), "another_face"),  # too blurred to tell
        (_face(ADULT, 90.0, x=200), (0, 0), None),  # two clear adults
        (_face(_estimate(0, 50, 20), 90.0, x=200), (0, 50), "another_face"),  # an adult for 18, not for 21
        (_face(MAYBE_MINOR, 49.0, x=200), (0, 0), None),  # background: under a quarter of the area
    ]
    for other, flags, reason in cases:
        decision = decide_age([other, subject])
        assert decision is not None
        assert (decision.estimate.under_18, decision.estimate.under_21) == flags, other
        assert decision.reason == reason


def test_a_50_or_100_from_the_bands_is_kept_and_called_uncertain() -> None:
    decision = decide_age([_face(MAYBE_MINOR), _face(ADULT, 90.0, x=200)])
    assert decision is not None and decision.estimate == MAYBE_MINOR and decision.reason == "uncertain_age"
    child = _estimate(100, 100, 8)
    decision = decide_age([_face(child), _face(MAYBE_MINOR, 90.0, x=200)])
    assert decision is not None and decision.estimate == child and decision.reason is None


# ---------------------------------------------------------------- the rules on real photos (faces-dev)


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


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
        age = subject_age(analyzer.analyze([image])[0])
        if age is not None and age.under_18 == 0:
            return image
    raise AssertionError("no dev adult of 30+ is cleared on their own: the bands are too cautious")


@pytest.fixture(scope="module")
def cleared_adults(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> list[np.ndarray]:
    """Two dev adults of 30+ that are each cleared alone (resized to 240 px)."""
    found = []
    for item in faces_dev.of_kind("age"):
        if item.age is None or item.age < 30:
            continue
        image = _square(_pixels(item.path), 240)
        age = subject_age(analyzer.analyze([image])[0])
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
    decision = decide_age(faces)
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
    assert subject.age is not None and subject.age.under_18 == 0
    assert other.age is not None and other.age.under_18 != 0
    assert decision.estimate.under_18 == 50 and decision.estimate.under_21 == 50
    assert decision.reason == "another_face"


def test_a_second_comparable_face_that_could_be_a_minor_withholds_the_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    # The child's face is a little smaller than the adult's: the adult is the subject, and the answer must
    # not say "adult" when it may be the child the photo is about.
    faces, decision = _decide(analyzer, _side_by_side(cleared_adult, _square(child, 200)))
    assert len(faces) == 2
    assert decision.estimate.under_18 != 0 and decision.estimate.under_21 != 0
    assert decision.reason == "another_face"


def test_two_adults_side_by_side_are_cleared(
    analyzer: FaceAnalyzer, cleared_adults: list[np.ndarray]
) -> None:
    first, second = cleared_adults
    faces, decision = _decide(analyzer, _side_by_side(first, _square(second, 220)))
    assert len(faces) == 2 and all(face.age is not None for face in faces)  # both were estimated
    assert decision.estimate.under_18 == 0 and decision.reason in (None, "uncertain_age")


def test_a_small_background_face_is_not_estimated_and_does_not_withhold_the_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    faces, decision = _decide(analyzer, _side_by_side(cleared_adult, _square(child, 90)))
    subject = max(faces, key=lambda face: face.detection.area)
    others = [face for face in faces if face is not subject]
    assert others and all(f.detection.area < OTHER_FACE_AREA_RATIO * subject.detection.area for f in others)
    assert all(face.age is None for face in others)  # no model time spent on them
    assert decision.estimate.under_18 == 0


def test_a_subject_below_the_age_bar_gets_50(analyzer: FaceAnalyzer, cleared_adult: np.ndarray) -> None:
    # Blurred hard enough to miss the age bar; alone in the frame, so only the quality rule applies.
    blurred = cv2.GaussianBlur(cleared_adult, (0, 0), 6)
    faces, decision = _decide(analyzer, blurred)
    assert len(faces) == 1
    assert (decision.estimate.under_18, decision.estimate.under_21) == (50, 50)
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
        possible_minor = any(face.age is None or face.age.under_18 != 0 for face in comparable)
        if possible_minor:
            assert decision.estimate.under_18 != 0, item.path.name
    assert crowded >= 1, "at least one dev group photo should have faces of comparable size"

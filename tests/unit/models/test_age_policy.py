from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from models.age_policy import COMPARABLE_AREA_RATIO, guarded, several_comparable_faces, subject_age
from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality
from tests.faces_dev import FacesDev


def _estimate(under_18: int, under_21: int) -> AgeEstimate:
    return AgeEstimate(
        age=30, expected_age=30.0, p_under_18=0.0, p_under_21=0.0, under_18=under_18, under_21=under_21
    )


def _detection(side: float, x: float = 0.0) -> DetectedFace:
    return DetectedFace(
        box=np.array([x, 0.0, x + side, side], dtype=np.float32),
        landmarks=np.zeros((5, 2), dtype=np.float32),
        score=0.95,
    )


def _quality(ok: bool) -> FaceQuality:
    return FaceQuality(
        face_size_px=100.0,
        detector_score=0.95,
        sharpness=100.0,
        yaw=0.0,
        pitch=0.5,
        roll_deg=0.0,
        enrol_ok=ok,
        search_ok=ok,
        reasons=() if ok else ("blurry",),
    )


@pytest.mark.parametrize(
    ("flags", "comparable", "quality_ok", "expected"),
    [
        ((0, 0), False, True, (0, 0)),
        ((0, 0), True, True, (50, 50)),
        ((0, 0), False, False, (50, 50)),
        ((0, 50), True, False, (50, 50)),
        ((50, 100), True, False, (50, 100)),  # 50 and 100 are never lowered
        ((100, 100), False, False, (100, 100)),
    ],
)
def test_guarded_only_withholds_zeros(
    flags: tuple[int, int], comparable: bool, quality_ok: bool, expected: tuple[int, int]
) -> None:
    result = guarded(_estimate(*flags), comparable_faces=comparable, subject_quality_ok=quality_ok)
    assert (result.under_18, result.under_21) == expected
    assert result.expected_age == 30.0


def test_comparable_faces_by_area() -> None:
    subject = _detection(100.0)
    assert not several_comparable_faces(subject, [subject])
    half_width = _detection(50.0, x=200)  # exactly a quarter of the area
    assert COMPARABLE_AREA_RATIO == 0.25
    assert several_comparable_faces(subject, [subject, half_width])
    assert not several_comparable_faces(subject, [subject, _detection(49.0, x=200)])
    # An identical box elsewhere is another face, not the subject.
    assert several_comparable_faces(subject, [subject, _detection(100.0, x=300)])


def test_subject_age_applies_every_rule() -> None:
    subject = AnalyzedFace(_detection(100.0), None, _estimate(0, 0), _quality(True))
    small = AnalyzedFace(_detection(40.0, x=200), None, None, _quality(True))
    large = AnalyzedFace(_detection(80.0, x=200), None, None, _quality(True))
    assert subject_age([]) is None
    assert subject_age([AnalyzedFace(_detection(100.0), None, None, _quality(True))]) is None
    alone = subject_age([subject])
    assert alone is not None and (alone.under_18, alone.under_21) == (0, 0)
    with_background = subject_age([small, subject])
    assert with_background is not None and with_background.under_18 == 0
    crowded = subject_age([large, subject])
    assert crowded is not None and (crowded.under_18, crowded.under_21) == (50, 50)
    blurred = AnalyzedFace(subject.detection, None, subject.age, _quality(False))
    result = subject_age([blurred])
    assert result is not None and (result.under_18, result.under_21) == (50, 50)
    unmeasured = AnalyzedFace(subject.detection, None, subject.age, None)
    result = subject_age([unmeasured])
    assert result is not None and result.under_18 == 50


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
def child(faces_dev: FacesDev) -> np.ndarray:
    young = [item for item in faces_dev.of_kind("age") if item.age is not None and item.age <= 11]
    assert young, "the dev set should hold children"
    return _pixels(young[0].path)


def _side_by_side(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    height = max(left.shape[0], right.shape[0])
    canvas = np.full((height + 80, left.shape[1] + right.shape[1] + 120, 3), 200, dtype=np.uint8)
    canvas[40 : 40 + left.shape[0], 40 : 40 + left.shape[1]] = left
    x = 80 + left.shape[1]
    canvas[40 : 40 + right.shape[0], x : x + right.shape[1]] = right
    return canvas


def test_a_second_comparable_face_withholds_the_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    # The child's face is a little smaller than the adult's: the adult is the subject, and the answer must
    # not say "adult" when it may be the child the photo is about.
    composite = _side_by_side(cleared_adult, _square(child, 200))
    faces = analyzer.analyze([composite])[0]
    assert len(faces) == 2
    age = subject_age(faces)
    assert age is not None
    assert age.under_18 != 0 and age.under_21 != 0


def test_a_small_background_face_does_not_withhold_the_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray, child: np.ndarray
) -> None:
    composite = _side_by_side(cleared_adult, _square(child, 90))
    faces = analyzer.analyze([composite])[0]
    subject = max(faces, key=lambda face: face.detection.area)
    others = [face for face in faces if face is not subject]
    assert others and all(f.detection.area < COMPARABLE_AREA_RATIO * subject.detection.area for f in others)
    age = subject_age(faces)
    assert age is not None and age.under_18 == 0


def test_a_subject_failing_the_quality_gate_gets_no_zero(
    analyzer: FaceAnalyzer, cleared_adult: np.ndarray
) -> None:
    # Blurred hard enough to fail the quality gate; alone in the frame, so only the quality rule applies.
    blurred = cv2.GaussianBlur(cleared_adult, (0, 0), 6)
    faces = analyzer.analyze([blurred])[0]
    if not faces:
        pytest.fail("the blurred adult face is no longer detected; use a milder blur")
    subject = max(faces, key=lambda face: face.detection.area)
    assert subject.quality is not None and not subject.quality.enrol_ok
    age = subject_age(faces)
    assert age is not None and age.under_18 != 0 and age.under_21 != 0


def test_group_photos_never_clear_the_subject(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    groups = faces_dev.of_kind("group")
    assert groups
    crowded = 0
    for item in groups:
        faces = analyzer.analyze([_pixels(item.path)])[0]
        subject = max(faces, key=lambda face: face.detection.area)
        if several_comparable_faces(subject.detection, [face.detection for face in faces]):
            crowded += 1
            age = subject_age(faces)
            assert age is not None and age.under_18 != 0 and age.under_21 != 0, item.path.name
    assert crowded >= 1, "at least one dev group photo should have faces of comparable size"

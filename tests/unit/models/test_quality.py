"""Face quality measurements and the enrolment / search bars."""

from __future__ import annotations

import dataclasses

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from models.chips import ARCFACE_TEMPLATE, CHIP_SIZE, align_chip, similarity_transform
from models.detector import DetectorOptions, FaceDetector
from models.quality import (
    QualityThresholds,
    assess_quality,
    blockiness,
    chip_measures,
    chip_sharpness,
    pose_from_landmarks,
)
from models.sessions import SessionOptions
from models.types import DetectedFace
from models.weights import resolve
from tests.faces_dev import FacesDev


def _face(box: tuple[float, float, float, float], landmarks: np.ndarray, score: float = 0.95) -> DetectedFace:
    return DetectedFace(np.asarray(box, np.float32), np.asarray(landmarks, np.float32), score)


def test_similarity_transform_recovers_a_known_similarity() -> None:
    angle, scale, shift = np.deg2rad(17.0), 2.3, np.asarray([40.0, -12.0])
    rotation = scale * np.asarray([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    moved = ARCFACE_TEMPLATE @ rotation.T + shift
    matrix = similarity_transform(ARCFACE_TEMPLATE, moved)
    np.testing.assert_allclose(matrix[:, :2], rotation, atol=1e-9)
    np.testing.assert_allclose(matrix[:, 2], shift, atol=1e-9)


def test_template_landmarks_are_frontal_and_level() -> None:
    pose = pose_from_landmarks(ARCFACE_TEMPLATE)
    assert abs(pose.yaw) < 0.05
    assert abs(pose.roll_deg) < 1.0
    assert 0.4 < pose.pitch < 0.6


def test_pose_reads_roll_and_a_turned_head() -> None:
    angle = np.deg2rad(30.0)
    rotation = np.asarray([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    rolled = pose_from_landmarks(ARCFACE_TEMPLATE @ rotation.T)
    assert rolled.roll_deg == pytest.approx(30.0, abs=1.0)
    assert abs(rolled.yaw) < 0.05  # roll alone is not a turned head
    turned = ARCFACE_TEMPLATE.copy()
    turned[2, 0] = turned[1, 0]  # nose tip in the column of the image-right eye
    assert pose_from_landmarks(turned).yaw > 0.9


def test_blur_lowers_sharpness(faces_dev: FacesDev) -> None:
    with Image.open(faces_dev.of_kind("identity")[0].path) as image:
        rgb = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    detector = FaceDetector(resolve("yunet_2023mar_int8bq"), DetectorOptions(), SessionOptions())
    face = max(detector.detect([rgb])[0], key=lambda found: found.area)
    sharp = align_chip(rgb, face.landmarks)
    assert sharp.shape == (CHIP_SIZE, CHIP_SIZE, 3)
    blurred = cv2.GaussianBlur(sharp, (0, 0), 3.0)
    assert chip_sharpness(blurred) < chip_sharpness(sharp) / 4
    good = assess_quality(face, sharp)
    assert good.enrol_ok and good.search_ok and good.reasons == ()
    bad = assess_quality(face, blurred)
    assert not bad.enrol_ok
    assert "blurry" in bad.reasons


def test_each_check_names_its_reason_and_the_search_bar_is_looser() -> None:
    chip = np.tile((np.indices((CHIP_SIZE, CHIP_SIZE)).sum(axis=0) % 2 * 255).astype(np.uint8)[..., None], 3)
    thresholds = QualityThresholds()
    enrol = thresholds.enrol
    size = (enrol.min_face_size_px + thresholds.search.min_face_size_px) / 2
    landmarks = ARCFACE_TEMPLATE * (size / CHIP_SIZE)
    small = assess_quality(_face((0, 0, size, size), landmarks), chip, thresholds)
    assert small.reasons == ("small_face",)
    assert small.search_ok and not small.enrol_ok
    tiny = assess_quality(_face((0, 0, 10, 10), ARCFACE_TEMPLATE * (10 / CHIP_SIZE)), chip, thresholds)
    assert not tiny.search_ok and not tiny.enrol_ok
    unsure = assess_quality(_face((0, 0, 200, 200), ARCFACE_TEMPLATE * 2, score=0.75), chip, thresholds)
    assert unsure.reasons == ("low_detector_score",)
    profile = ARCFACE_TEMPLATE * 2
    profile[2, 0] = profile[1, 0] + 10
    turned = assess_quality(_face((0, 0, 200, 200), profile), chip, thresholds)
    assert turned.reasons == ("extreme_pose",) and not turned.search_ok
    stricter = dataclasses.replace(thresholds, enrol=dataclasses.replace(enrol, min_sharpness=1e9))
    assert assess_quality(_face((0, 0, 200, 200), ARCFACE_TEMPLATE * 2), chip, stricter).reasons == (
        "blurry",
    )


# ---------------------------------------------------------------- the measures the age interval reads


def _textured(seed: int = 3, side: int = 112) -> np.ndarray:
    """A face-sized RGB picture with detail at every scale (smoothed noise of several widths)."""
    rng = np.random.default_rng(seed)
    layers = [cv2.GaussianBlur(rng.normal(0, 1, (side, side)), (0, 0), s) * s for s in (1.0, 3.0, 9.0)]
    grey = 128 + 20 * sum(layers) / np.std(sum(layers))
    return np.repeat(np.clip(grey, 0, 255).astype(np.uint8)[..., None], 3, axis=2)


def test_chip_measures_follow_light_noise_and_blur() -> None:
    from tests.degradations import blurrier, darker, noisier

    chip = _textured()
    clean = chip_measures(chip)
    dark = chip_measures(darker(chip, 0.3))
    assert dark.brightness < 0.4 * clean.brightness and dark.contrast < 0.4 * clean.contrast
    textures = [chip_measures(noisier(chip, std, 1)).texture for std in (0.0, 8.0, 16.0)]
    assert textures[0] < textures[1] < textures[2]
    blurred = [chip_measures(blurrier(chip, share)).texture for share in (0.005, 0.01, 0.02)]
    assert clean.texture > blurred[0] > blurred[1] > blurred[2]


def test_blockiness_grows_with_jpeg_compression_and_needs_a_large_enough_box() -> None:
    from tests.degradations import recompressed

    image = cv2.resize(_textured(5, 200), (400, 400), interpolation=cv2.INTER_CUBIC)
    box = np.array([40.0, 40.0, 360.0, 360.0])
    values = [blockiness(recompressed(image, quality), box) for quality in (95, 30, 8)]
    assert values[0] < values[1] < values[2]
    assert values[0] < 1.5 < values[2]
    assert np.isnan(blockiness(image, np.array([10.0, 10.0, 30.0, 30.0])))

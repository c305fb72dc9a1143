"""YuNet on ONNX Runtime: recall on the dev photos, batching, odd inputs, coordinates."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

from models.arrays import to_rgb
from models.detector import DetectorOptions, FaceDetector
from models.sessions import SessionOptions
from models.types import DetectedFace
from models.weights import resolve
from tests.faces_dev import FacesDev


def load_rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


def image_mode(path: Path) -> str:
    with Image.open(path) as image:
        return image.mode


@pytest.fixture(scope="module")
def detector() -> FaceDetector:
    return FaceDetector(
        resolve("yunet_2023mar_int8bq"), DetectorOptions(), SessionOptions(intra_op_threads=1)
    )


@pytest.fixture(scope="module")
def identity_images(faces_dev: FacesDev) -> list[np.ndarray]:
    return [load_rgb(item.path) for item in faces_dev.of_kind("identity")]


@pytest.fixture(scope="module")
def large_portraits(identity_images: list[np.ndarray]) -> list[np.ndarray]:
    """Identity photos with context around the face (the others are already tight 112/250 px crops)."""
    return [image for image in identity_images if min(image.shape[:2]) >= 300]


def assert_same_faces(left: list[DetectedFace], right: list[DetectedFace], tolerance: float = 1e-3) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        np.testing.assert_allclose(a.box, b.box, atol=tolerance)
        np.testing.assert_allclose(a.landmarks, b.landmarks, atol=tolerance)
        assert a.score == pytest.approx(b.score, abs=1e-5)


def test_every_identity_photo_has_a_face(detector: FaceDetector, identity_images: list[np.ndarray]) -> None:
    found = detector.detect(identity_images)
    assert len(identity_images) == 30
    assert [i for i, faces in enumerate(found) if not faces] == []


def test_tight_age_crops_are_found(detector: FaceDetector, faces_dev: FacesDev) -> None:
    # Measured: 60/60 with the default pad (weakest best score 0.82 against a 0.7 threshold).
    crops = [load_rgb(item.path) for item in faces_dev.of_kind("age")]
    found = detector.detect(crops)
    assert len(crops) == 60
    assert sum(1 for faces in found if faces) >= 58


def test_padding_is_what_finds_tight_crops(detector: FaceDetector, faces_dev: FacesDev) -> None:
    # Without the border the same crops score lower (weakest 0.59 measured): fewer pass the threshold.
    unpadded = FaceDetector(
        resolve("yunet_2023mar_int8bq"), DetectorOptions(pad_ratio=0.0), SessionOptions(intra_op_threads=1)
    )
    crops = [load_rgb(item.path) for item in faces_dev.of_kind("age")]
    with_pad = min(max(f.score for f in faces) for faces in detector.detect(crops))
    without_pad = min(max((f.score for f in faces), default=0.0) for faces in unpadded.detect(crops))
    assert with_pad > without_pad + 0.1


def test_negatives_have_no_faces(detector: FaceDetector, faces_dev: FacesDev) -> None:
    negatives = faces_dev.of_kind("negative")
    assert len(negatives) == 5
    assert detector.detect([load_rgb(item.path) for item in negatives]) == [[] for _ in negatives]


def test_group_photos_face_counts(detector: FaceDetector, faces_dev: FacesDev) -> None:
    # Measured: every labelled face is found (4 and 3), all with scores >= 0.90.
    groups = faces_dev.of_kind("group")
    found = detector.detect([load_rgb(item.path) for item in groups])
    assert [len(faces) for faces in found] == [item.n_faces for item in groups]


def test_batch_equals_one_by_one(
    detector: FaceDetector, faces_dev: FacesDev, identity_images: list[np.ndarray]
) -> None:
    images = identity_images[:6] + [load_rgb(item.path) for item in faces_dev.of_kind("group")]
    images.append(load_rgb(faces_dev.of_kind("negative")[0].path))
    batched = detector.detect(images)
    assert sum(len(faces) for faces in batched) >= len(images) + 4  # several faces, one empty image
    for image, faces in zip(images, batched, strict=True):
        assert_same_faces(faces, detector.detect([image])[0])


@pytest.mark.parametrize("images_per_run", [3, 16])
def test_runs_of_several_images_find_the_same_faces(
    detector: FaceDetector, faces_dev: FacesDev, identity_images: list[np.ndarray], images_per_run: int
) -> None:
    """On CPU the detector runs one image per inference by default (cheaper); runs of several images, one
    of them cut short by the end of the batch, decode to the same faces in the same order."""
    assert detector.images_per_run == 1
    images = identity_images[:6] + [load_rgb(item.path) for item in faces_dev.of_kind("group")]
    several = FaceDetector(
        resolve("yunet_2023mar_int8bq"),
        DetectorOptions(cpu_images_per_run=images_per_run),
        SessionOptions(intra_op_threads=1),
    )
    assert several.images_per_run == images_per_run
    for one, many in zip(detector.detect(images), several.detect(images), strict=True):
        assert_same_faces(one, many)
    with pytest.raises(ValueError, match="cpu_images_per_run"):
        DetectorOptions(cpu_images_per_run=0)


def test_matches_opencv_yunet_on_the_same_canvas(detector: FaceDetector, faces_dev: FacesDev) -> None:
    """Our graph rewrite and decoding agree with OpenCV's own YuNet implementation (reference only)."""
    options = detector.options
    reference = cv2.FaceDetectorYN.create(
        str(resolve("yunet_2023mar_int8bq")),
        "",
        (options.input_size, options.input_size),
        options.score_threshold,
        options.nms_threshold,
        5000,
    )
    for item in faces_dev.of_kind("group"):
        prepared = detector.prepare(load_rgb(item.path))
        ours = detector.detect_prepared([prepared])[0]
        _, rows = reference.detect(np.ascontiguousarray(prepared.tensor.transpose(1, 2, 0)))
        assert rows is not None
        rows = rows[np.argsort(-rows[:, 14])]
        assert len(rows) == len(ours)
        offset = np.array([prepared.pad_x, prepared.pad_y], dtype=np.float32)
        for face, row in zip(ours, rows, strict=True):
            x, y, w, h = row[:4]
            expected_box = (np.array([x, y, x + w, y + h]) - np.tile(offset, 2)) / prepared.scale
            expected_points = (row[4:14].reshape(5, 2) - offset) / prepared.scale
            np.testing.assert_allclose(face.box, expected_box, atol=1e-2)
            np.testing.assert_allclose(face.landmarks, expected_points, atol=1e-2)
            assert face.score == pytest.approx(float(row[14]), abs=1e-4)


def test_grayscale_and_rgba_inputs(detector: FaceDetector, faces_dev: FacesDev) -> None:
    # The dev set's LFW photos are stored grayscale; take the first.
    path = next(item.path for item in faces_dev.of_kind("identity") if image_mode(item.path) == "L")
    with Image.open(path) as image:
        gray = np.asarray(ImageOps.exif_transpose(image).convert("L"))
    assert gray.ndim == 2
    rgb = load_rgb(path)
    from_gray = detector.detect([gray])[0]
    assert from_gray
    assert_same_faces(from_gray, detector.detect([rgb])[0])
    assert_same_faces(detector.detect([gray[:, :, None]])[0], from_gray)

    colour = load_rgb(faces_dev.of_kind("identity")[0].path)
    opaque = np.dstack([colour, np.full(colour.shape[:2], 255, dtype=np.uint8)])
    assert_same_faces(detector.detect([opaque])[0], detector.detect([colour])[0])


def test_to_rgb_composites_transparency_over_white() -> None:
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = [10, 20, 30, 255]
    rgba[0, 1] = [200, 0, 0, 0]  # fully transparent: its colour must not show
    rgb = to_rgb(rgba)
    assert rgb.shape == (2, 2, 3)
    assert rgb[0, 0].tolist() == [10, 20, 30]
    assert rgb[0, 1].tolist() == [255, 255, 255]
    with pytest.raises(ValueError):
        to_rgb(np.zeros((4, 4), dtype=np.uint16))
    with pytest.raises(ValueError):
        to_rgb(np.zeros((4, 4, 2), dtype=np.uint8))


@pytest.mark.parametrize(
    "image",
    [
        np.zeros((1, 1, 3), dtype=np.uint8),
        np.zeros((480, 640, 3), dtype=np.uint8),
        np.full((1, 4000, 3), 128, dtype=np.uint8),
        np.full((7, 3), 255, dtype=np.uint8),
    ],
    ids=["1x1", "black", "one-row-strip", "tiny-gray"],
)
def test_images_without_faces_give_empty_lists(detector: FaceDetector, image: np.ndarray) -> None:
    assert detector.detect([image]) == [[]]


def test_empty_batch(detector: FaceDetector) -> None:
    assert detector.detect([]) == []
    assert detector.detect_prepared([]) == []


def test_face_filling_the_frame_and_at_the_edges(
    detector: FaceDetector, large_portraits: list[np.ndarray]
) -> None:
    assert len(large_portraits) >= 10
    for image in large_portraits:
        x1, y1, x2, y2 = detector.detect([image])[0][0].box.round().astype(int)
        quarter_w, quarter_h = (x2 - x1) // 4, (y2 - y1) // 4
        cases = {
            "face box is the whole frame": image[y1:y2, x1:x2],
            "right quarter cut off": image[:, : x2 - quarter_w],
            "left quarter cut off": image[:, x1 + quarter_w :],
            "chin cut off": image[: y2 - quarter_h],
        }
        for name, crop in cases.items():
            faces = detector.detect([np.ascontiguousarray(crop)])[0]
            assert faces, name


def test_coordinates_are_consistent(
    detector: FaceDetector, faces_dev: FacesDev, large_portraits: list[np.ndarray]
) -> None:
    images = large_portraits + [load_rgb(item.path) for item in faces_dev.of_kind("group")]
    for image, faces in zip(images, detector.detect(images), strict=True):
        height, width = image.shape[:2]
        scores = [face.score for face in faces]
        assert scores == sorted(scores, reverse=True)
        for face in faces:
            assert face.box.dtype == np.float32 and face.box.shape == (4,)
            assert face.landmarks.dtype == np.float32 and face.landmarks.shape == (5, 2)
            x1, y1, x2, y2 = face.box
            assert 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height
            assert min(x2 - x1, y2 - y1) >= detector.options.min_face_size
            # Measured: YuNet's points never leave its box on the dev photos.
            assert np.all((face.landmarks >= face.box[:2]) & (face.landmarks <= face.box[2:]))
            # YuNet order: the subject's right eye (image left) comes first.
            assert face.landmarks[0, 0] < face.landmarks[1, 0]


def test_min_face_size_and_top_k(faces_dev: FacesDev) -> None:
    group = faces_dev.of_kind("group")[0]
    image = load_rgb(group.path)
    model = resolve("yunet_2023mar_int8bq")
    threads = SessionOptions(intra_op_threads=1)
    assert len(FaceDetector(model, DetectorOptions(top_k=2), threads).detect([image])[0]) == 2
    assert FaceDetector(model, DetectorOptions(min_face_size=500), threads).detect([image]) == [[]]


def test_other_input_size(faces_dev: FacesDev) -> None:
    """Height and width are symbolic too: a 320 px network input runs and still finds the group's faces."""
    small = FaceDetector(
        resolve("yunet_2023mar_int8bq"), DetectorOptions(input_size=320), SessionOptions(intra_op_threads=1)
    )
    group = faces_dev.of_kind("group")[1]
    prepared = small.prepare(load_rgb(group.path))
    assert prepared.tensor.shape == (3, 320, 320) and prepared.tensor.dtype == np.uint8
    assert len(small.detect_prepared([prepared])[0]) == group.n_faces


def test_prepare_rejects_mismatched_tensors(detector: FaceDetector, faces_dev: FacesDev) -> None:
    other = FaceDetector(
        resolve("yunet_2023mar_int8bq"), DetectorOptions(input_size=320), SessionOptions(intra_op_threads=1)
    )
    prepared = other.prepare(load_rgb(faces_dev.of_kind("group")[0].path))
    with pytest.raises(ValueError, match="shape"):
        detector.detect_prepared([prepared])
    with pytest.raises(ValueError):
        DetectorOptions(input_size=600)

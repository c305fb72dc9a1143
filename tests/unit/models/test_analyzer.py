from __future__ import annotations

import io
import itertools
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from models.age_policy import age_faces as policy_age_faces
from models.age_v2 import VIEWS_PER_FACE as AGE_VIEWS
from models.age_v2 import AgeCalibration
from models.analyzer import (
    FaceAnalyzer,
    FaceCrops,
    ModelConfig,
    largest_face,
    load_face_analyzer,
)
from models.calibration import FaceScoreCalibration
from models.detector import DetectorOptions
from models.embedder import FUSED_DIM, FusedEmbedder
from models.types import AnalyzedFace, DetectedFace, subject_index
from models.weights import default_models_dir
from tests.faces_dev import FacesDev, LabelledImage

EXIF_ORIENTATION = 0x0112


@pytest.fixture(scope="module")
def analyzer() -> FaceAnalyzer:
    return load_face_analyzer(ModelConfig(intra_op_threads=1))


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


def _probe(analyzer: FaceAnalyzer, image: np.ndarray) -> AnalyzedFace:
    face = largest_face(analyzer.analyze([image])[0])
    assert face is not None, "no face found"
    return face


def _cosine(a: AnalyzedFace, b: AnalyzedFace) -> float:
    assert a.embedding is not None and b.embedding is not None
    return float(a.embedding @ b.embedding)


# The default bar of a 100-face gallery: score 0.4, FMR 1e-4 on faces-calib.
MATCH_COSINE = FaceScoreCalibration.load().cosine_for_score(0.4)


@pytest.fixture(scope="module")
def identity_probes(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> list[tuple[LabelledImage, AnalyzedFace]]:
    labelled = faces_dev.of_kind("identity")
    assert len(labelled) >= 20
    return [(item, _probe(analyzer, _pixels(item.path))) for item in labelled]


@pytest.fixture(scope="module")
def rgb_photo(faces_dev: FacesDev) -> np.ndarray:
    """A colour identity photo with one clear face."""
    return _pixels(faces_dev.of_kind("identity")[0].path)


def test_same_person_within_threshold_and_different_people_beyond(
    identity_probes: list[tuple[LabelledImage, AnalyzedFace]],
) -> None:
    same: list[tuple[str, str, float]] = []
    different: list[tuple[str, str, float]] = []
    for (item_a, face_a), (item_b, face_b) in itertools.combinations(identity_probes, 2):
        pair = (item_a.path.name, item_b.path.name, round(_cosine(face_a, face_b), 4))
        (same if item_a.identity == item_b.identity else different).append(pair)
    assert len(same) >= 20 and len(different) >= 200
    assert [pair for pair in same if pair[2] < MATCH_COSINE] == []
    assert [pair for pair in different if pair[2] >= MATCH_COSINE] == []


def test_faces_carry_descriptor_and_age(identity_probes: list[tuple[LabelledImage, AnalyzedFace]]) -> None:
    for _, face in identity_probes:
        assert face.embedding is not None and face.embedding.shape == (FUSED_DIM,)
        assert face.embedding.dtype == np.float32
        # Face model v2 vectors are unit length (searched by inner product).
        assert float(np.linalg.norm(face.embedding)) == pytest.approx(1.0, abs=1e-5)
        assert face.age is not None and 0 <= face.age.age <= 80
        assert face.detection.box.shape == (4,) and face.detection.area > 0


def test_non_face_images_have_no_faces(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    negatives = faces_dev.of_kind("negative")
    assert negatives
    results = analyzer.analyze([_pixels(item.path) for item in negatives])
    assert {item.path.name: len(found) for item, found in zip(negatives, results, strict=True)} == {
        item.path.name: 0 for item in negatives
    }
    assert largest_face(results[0]) is None


def test_group_photos_face_counts(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    groups = faces_dev.of_kind("group")
    assert groups
    results = analyzer.analyze([_pixels(item.path) for item in groups])
    assert [len(found) for found in results] == [item.n_faces for item in groups]


def test_grayscale_and_rgba_inputs(analyzer: FaceAnalyzer, rgb_photo: np.ndarray) -> None:
    reference = _probe(analyzer, rgb_photo)
    opaque = np.concatenate([rgb_photo, np.full((*rgb_photo.shape[:2], 1), 255, np.uint8)], axis=2)
    rgba = _probe(analyzer, opaque)
    # Fully opaque RGBA is the same picture: the same numbers come out.
    assert rgba.embedding is not None and reference.embedding is not None
    np.testing.assert_allclose(rgba.embedding, reference.embedding, atol=1e-5)
    gray = np.asarray(Image.fromarray(rgb_photo).convert("L"))
    assert gray.ndim == 2
    for variant in (gray, gray[:, :, None]):
        assert _cosine(_probe(analyzer, variant), reference) > 0.95


def test_grayscale_dev_photo(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    # The LFW identity photos are stored as 8-bit grayscale; feed them as 2-D arrays.
    gray_items = []
    for item in faces_dev.of_kind("identity"):
        with Image.open(item.path) as image:
            if image.mode == "L":
                gray_items.append(np.asarray(image))
    assert gray_items, "the dev set should contain grayscale photos"
    found = analyzer.analyze(gray_items)
    assert all(len(faces) >= 1 for faces in found)


def test_exif_rotated_jpeg(analyzer: FaceAnalyzer, rgb_photo: np.ndarray) -> None:
    upright = Image.fromarray(rgb_photo)
    # Store the pixels turned 90 degrees counter-clockwise and tag them Orientation 6 ("rotate 90 CW to
    # display"), as a phone held sideways does.
    stored = upright.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", quality=95, exif=exif.tobytes())

    with Image.open(io.BytesIO(buffer.getvalue())) as loaded:
        assert loaded.getexif()[EXIF_ORIENTATION] == 6
        assert loaded.size == (upright.height, upright.width)
        restored = np.asarray(ImageOps.exif_transpose(loaded).convert("RGB"))
    assert restored.shape == rgb_photo.shape
    face = _probe(analyzer, restored)
    # Only JPEG re-compression separates this from the original photo.
    assert _cosine(face, _probe(analyzer, rgb_photo)) > 0.98


def test_batch_equals_one_by_one(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    items = [
        *faces_dev.of_kind("identity")[:3],
        *faces_dev.of_kind("group"),
        faces_dev.of_kind("negative")[0],
    ]
    images = [_pixels(item.path) for item in items]
    batched = analyzer.analyze(images)
    single = [analyzer.analyze([image])[0] for image in images]
    assert [len(found) for found in batched] == [len(found) for found in single]
    assert sum(len(found) for found in batched) >= 6
    for faces_a, faces_b in zip(batched, single, strict=True):
        for a, b in zip(faces_a, faces_b, strict=True):
            np.testing.assert_allclose(a.detection.box, b.detection.box, atol=0.05)
            assert a.embedding is not None and b.embedding is not None
            np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-4)
            # Age runs on the subject and the faces the age rules need, the same faces in both runs.
            assert (a.age is None) == (b.age is None)
            if a.age is not None and b.age is not None:
                assert a.age.expected_age == pytest.approx(b.age.expected_age, abs=1e-2)
                assert a.age.p_under_18 == pytest.approx(b.age.p_under_18, abs=1e-2)
        if faces_a:
            estimated = policy_age_faces([face.detection for face in faces_a])
            assert estimated[0] == subject_index([face.detection for face in faces_a])
            assert [face.age is not None for face in faces_a] == [i in estimated for i in range(len(faces_a))]


def test_stages_compose_to_analyze(faces_dev: FacesDev, analyzer: FaceAnalyzer) -> None:
    images = [_pixels(item.path) for item in faces_dev.of_kind("group")]
    images.append(_pixels(faces_dev.of_kind("negative")[0].path))
    detections = analyzer.detect(images)
    crops = [analyzer.align_and_crop(image, faces) for image, faces in zip(images, detections, strict=True)]
    results = analyzer.infer(crops)
    staged = [analyzer.assemble(faces, result) for faces, result in zip(detections, results, strict=True)]
    direct = analyzer.analyze(images)
    assert [len(f) for f in staged] == [len(f) for f in direct]
    for a, b in zip(itertools.chain(*staged), itertools.chain(*direct), strict=True):
        assert a.embedding is not None and b.embedding is not None
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-4)
    assert crops[-1].n_faces == 0
    assert crops[-1].descriptor_chips is not None and crops[-1].descriptor_chips.shape == (0, 150, 150, 3)
    assert crops[0].age_views is not None and crops[0].age_views.shape[1:] == (AGE_VIEWS, 224, 224, 3)
    # Group photo: age views for the subject first, then for the faces of comparable size (all four here).
    assert crops[0].age_faces == policy_age_faces(detections[0])
    assert len(crops[0].age_views) == len(crops[0].age_faces) == len(detections[0])
    assert crops[0].age_faces[0] == subject_index(detections[0])
    assert crops[-1].age_views is not None and crops[-1].age_views.shape[0] == 0 and crops[-1].age_faces == ()


def test_optional_stages(analyzer: FaceAnalyzer, rgb_photo: np.ndarray) -> None:
    (detect_only,) = analyzer.analyze([rgb_photo], embed=False, estimate_age=False)
    assert detect_only and all(f.embedding is None and f.age is None for f in detect_only)
    (embed_only,) = analyzer.analyze([rgb_photo], estimate_age=False)
    assert all(f.embedding is not None and f.age is None for f in embed_only)
    (age_only,) = analyzer.analyze([rgb_photo], embed=False)
    assert all(f.embedding is None for f in age_only)
    subject = largest_face(age_only)
    assert subject is not None and subject.age is not None
    assert all(f.age is None for f in age_only if f is not subject)
    empty = FaceCrops(descriptor_chips=None, age_views=None)
    assert analyzer.infer([empty])[0].embeddings is None


def test_empty_input(analyzer: FaceAnalyzer) -> None:
    assert analyzer.analyze([]) == []
    assert analyzer.infer([]) == []


def test_health_check_runs(analyzer: FaceAnalyzer) -> None:
    analyzer.check()


def test_largest_face_picks_the_biggest_box() -> None:
    def face(x2: float) -> AnalyzedFace:
        box = np.array([0, 0, x2, 10], dtype=np.float32)
        return AnalyzedFace(DetectedFace(box, np.zeros((5, 2), np.float32), 0.9), None, None)

    faces = [face(5), face(20), face(20), face(3)]
    assert largest_face(faces) is faces[1]
    assert largest_face([]) is None


def test_model_config_from_dict() -> None:
    # A directory that holds the converted models (the age estimator is loaded from it below).
    models_dir = default_models_dir()
    config = ModelConfig.from_dict(
        {
            "intra_op_threads": 2,
            "models_dir": str(models_dir),
            "provider_preference": ["CPUExecutionProvider"],
            "detector": {"score_threshold": 0.7},
        }
    )
    assert config.intra_op_threads == 2
    assert config.models_dir == models_dir
    assert config.provider_preference == ("CPUExecutionProvider",)
    assert config.detector == DetectorOptions(score_threshold=0.7)
    assert config.load_age_estimator().calibration == AgeCalibration.load()
    assert config.session_options().intra_op_threads == 2
    assert ModelConfig.from_dict({}) == ModelConfig()
    with pytest.raises(ValueError, match="unknown model_config keys"):
        ModelConfig.from_dict({"intra_op_thread": 2})
    with pytest.raises(ValueError, match="unknown model_config keys"):  # the flags are age_policy's now
        ModelConfig.from_dict({"age_bands": {"under_18_adult_from": 30.0}})


def test_every_detected_face_carries_its_quality(analyzer: FaceAnalyzer, rgb_photo: np.ndarray) -> None:
    for embed, estimate_age in ((True, False), (False, True), (False, False)):
        faces = analyzer.analyze([rgb_photo], embed=embed, estimate_age=estimate_age)[0]
        assert faces
        for face in faces:
            assert face.quality is not None
            assert face.quality.face_size_px > 0 and face.quality.sharpness > 0
    probe = largest_face(analyzer.analyze([rgb_photo], embed=False, estimate_age=False)[0])
    assert probe is not None and probe.quality is not None and probe.quality.enrol_ok


def _v2(analyzer: FaceAnalyzer) -> FusedEmbedder:
    """The default face model: face model v2, whose two descriptors the tests below watch."""
    assert isinstance(analyzer.embedder, FusedEmbedder)
    return analyzer.embedder


def test_only_the_models_a_request_needs_run(
    analyzer: FaceAnalyzer, rgb_photo: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    for name, model, method in (
        ("dlib", _v2(analyzer).dlib, "embed"),
        ("sface", _v2(analyzer).sface, "embed"),
        ("age", analyzer.age_estimator, "estimate"),
    ):
        original = getattr(model, method)

        def spy(*args: object, _name: str = name, _original: object = original) -> object:
            runs.append(_name)
            return _original(*args)  # type: ignore[operator]

        monkeypatch.setattr(model, method, spy)
    analyzer.analyze([rgb_photo], embed=True, estimate_age=False)  # face search
    assert runs == ["dlib", "sface"]
    runs.clear()
    analyzer.analyze([rgb_photo], embed=False, estimate_age=True)  # age estimation, no enrolment
    assert runs == ["age"]


def test_a_mixed_batch_runs_each_model_only_on_the_faces_that_need_it(
    analyzer: FaceAnalyzer, rgb_photo: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[int]] = {"dlib": [], "age": []}
    for name, model, method in (
        ("dlib", _v2(analyzer).dlib, "embed"),
        ("age", analyzer.age_estimator, "estimate"),
    ):
        original = getattr(model, method)

        def spy(chips: np.ndarray, _name: str = name, _original: object = original) -> object:
            seen[_name].append(len(chips))
            return _original(chips)  # type: ignore[operator]

        monkeypatch.setattr(model, method, spy)
    one_face = len(analyzer.analyze([rgb_photo], embed=False, estimate_age=False)[0])
    search, age = analyzer.analyze_each([rgb_photo, rgb_photo], [(True, False), (False, True)])
    assert seen == {"dlib": [one_face], "age": [one_face]}  # one run each, over one image's faces
    assert all(face.embedding is not None and face.age is None for face in search)
    assert all(face.embedding is None and face.age is not None for face in age)
    reference = analyzer.analyze([rgb_photo], embed=True, estimate_age=False)[0]
    for staged, whole in zip(search, reference, strict=True):
        assert staged.embedding is not None and whole.embedding is not None
        np.testing.assert_allclose(staged.embedding, whole.embedding, atol=1e-5)

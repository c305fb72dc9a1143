"""A recognition model the operator brings (models/arcface.py), tested with a real one: the service's own
SFace behind an ArcFace-convention input (tests/wrapped_sface.py). Through the operator-model path
(registry entry, session factory, ArcFace chips from the detector's landmarks, (x - 127.5) / 127.5, unit
vectors) it must give SFace's own embeddings on real faces; what it refuses, it refuses by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image, ImageOps

from models import weights
from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.arcface import ArcFaceEmbedder, inspect
from models.chips import align_chip, aligned_chips
from models.embedder import SFaceEmbedder
from models.errors import ModelFormatError, WeightFileError
from models.face_model import OperatorFaceModel
from models.runners import DescriptorChips, EmbedderRunner
from models.sessions import SessionOptions
from models.types import largest_face
from tests.faces_dev import FacesDev
from tests.wrapped_sface import write_wrapped_sface

CPU_ONLY = SessionOptions(intra_op_threads=1, provider_preference=("CPUExecutionProvider",))


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> OperatorFaceModel:
    path, sha256 = write_wrapped_sface(tmp_path_factory.mktemp("operator-model"))
    return OperatorFaceModel(path=path, sha256=sha256, dim=128)


def _rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


@pytest.fixture(scope="module")
def analyzer(wrapped: OperatorFaceModel) -> FaceAnalyzer:
    return load_face_analyzer(ModelConfig(face_model=wrapped))


@pytest.fixture(scope="module")
def sface() -> SFaceEmbedder:
    return SFaceEmbedder(weights.converted("sface_2021dec_int8bq"), CPU_ONLY)


def test_the_service_analysis_with_the_operator_model_gives_sfaces_own_embeddings(
    analyzer: FaceAnalyzer, sface: SFaceEmbedder, wrapped: OperatorFaceModel, faces_dev: FacesDev
) -> None:
    """Every faces-dev identity photo analysed as the worker does, with the wrapped SFace as the face
    model: the vector equals SFace's own on the ArcFace chip of the same face (aligned from YuNet's
    landmarks), and dlib's landmarks are never run."""
    assert analyzer.embedder.version == wrapped.version and analyzer.embedder.dim == 128
    assert analyzer.cropper.aligner is None
    photos = [_rgb(item.path) for item in faces_dev.of_kind("identity")]
    found = analyzer.analyze(photos, embed=True, estimate_age=False)
    for rgb, faces in zip(photos, found, strict=True):
        probe = largest_face(faces)
        assert probe is not None and probe.embedding is not None
        own = sface.embed(align_chip(rgb, probe.detection.landmarks)[None])[0]
        np.testing.assert_allclose(probe.embedding, own, atol=1e-5)
        assert float(np.linalg.norm(probe.embedding)) == pytest.approx(1.0, abs=1e-5)
    crops = analyzer.align_and_crop(photos[0], [f.detection for f in found[0]])
    assert crops.descriptor_chips is None and crops.sface_chips is not None


def test_batches_runs_and_a_batch_fixed_at_one_give_the_same_vectors(
    wrapped: OperatorFaceModel, sface: SFaceEmbedder, faces_dev: FacesDev, tmp_path: Path
) -> None:
    chips = _chips(faces_dev)
    embedder = ArcFaceEmbedder(wrapped.path, CPU_ONLY, wrapped)
    expected = sface.embed(chips)
    np.testing.assert_allclose(embedder.embed(None, chips), expected, atol=1e-6)
    assert embedder.embed(None, chips[:0]).shape == (0, 128)
    # The split topology's embedder deployment: runs of faces across requests, no dlib chips.
    runner = EmbedderRunner(embedder)
    halves = [DescriptorChips(None, chips[:5]), DescriptorChips(None, chips[5:])]
    joined = np.concatenate(runner.run(halves, max_faces_per_run=3))
    np.testing.assert_allclose(joined, expected, atol=1e-6)
    # Some models fix their batch at 1: they run one face at a time.
    fixed = onnx.load(str(wrapped.path))
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    fixed_path = tmp_path / "fixed.onnx"
    onnx.save(fixed, str(fixed_path))
    spec = dataclasses.replace(wrapped, path=fixed_path, sha256=weights.sha256_of(fixed_path))
    np.testing.assert_allclose(
        ArcFaceEmbedder(fixed_path, CPU_ONLY, spec).embed(None, chips), expected, atol=1e-6
    )


def _chips(faces_dev: FacesDev) -> np.ndarray:
    from models.detector import DetectorOptions, FaceDetector

    detector = FaceDetector(weights.resolve("yunet_2023mar_int8bq"), DetectorOptions(), CPU_ONLY)
    out = []
    for item in faces_dev.of_kind("identity")[:9]:
        rgb = _rgb(item.path)
        face = max(detector.detect([rgb])[0], key=lambda found: found.area)
        out.append(aligned_chips(rgb, [face.landmarks])[0])
    return np.stack(out)


def test_a_wrong_file_size_or_format_is_refused_by_name(wrapped: OperatorFaceModel, tmp_path: Path) -> None:
    other_hash = dataclasses.replace(wrapped, sha256="0" * 64)
    with pytest.raises(WeightFileError, match="sha256"):
        ModelConfig(face_model=other_hash).verify_files()
    with pytest.raises(WeightFileError, match="sha256"):
        ModelConfig(face_model=other_hash).load_embedder()
    with pytest.raises(ModelFormatError, match="FACESEARCH_FACE_MODEL_DIM=128"):
        ArcFaceEmbedder(wrapped.path, CPU_ONLY, dataclasses.replace(wrapped, dim=512))
    dlib = weights.converted("dlib_resnet_v1")
    with pytest.raises(ModelFormatError, match=r"\[N, 3, 112, 112\]"):
        ArcFaceEmbedder(dlib, CPU_ONLY, dataclasses.replace(wrapped, path=dlib))
    not_onnx = tmp_path / "not.onnx"
    not_onnx.write_bytes(b"not a model")
    with pytest.raises(ModelFormatError, match="ONNX Runtime cannot load it"):
        ArcFaceEmbedder(not_onnx, CPU_ONLY, dataclasses.replace(wrapped, path=not_onnx))
    with pytest.raises(ValueError, match="face_model"):
        ModelConfig.from_dict({"face_model": {"path": str(wrapped.path)}})


def test_inspect_finds_the_recognition_model_of_a_folder(wrapped: OperatorFaceModel, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "w600k_like.onnx").write_bytes(wrapped.path.read_bytes())
    (pack / "dlib.onnx").write_bytes(weights.converted("dlib_resnet_v1").read_bytes())
    found = {model.path.name: model for model in inspect(pack)}
    assert found["w600k_like.onnx"].recognition and found["w600k_like.onnx"].dim == 128
    assert found["w600k_like.onnx"].sha256 == wrapped.sha256
    assert not found["dlib.onnx"].recognition and "112" in found["dlib.onnx"].note
    with pytest.raises(ModelFormatError, match="no such file"):
        inspect(pack / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match=r"no \.onnx file"):
        inspect(tmp_path / "empty")

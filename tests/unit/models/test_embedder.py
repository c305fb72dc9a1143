"""The converted ResNet against dlib-bin's own descriptor on real faces (cache: model_build/test_fetch)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import dlib
import numpy as np
import onnx
import pytest
from PIL import Image

from model_build.dlib_dat import read_dnn
from model_build.dlib_resnet import build_descriptor_model
from model_build.fetch import ensure_converted
from models import weights
from models.embedder import MODEL_VERSION, FaceEmbedder
from models.errors import ModelFormatError
from models.sessions import SessionOptions
from tests.faces_dev import FacesDev

CPU_ONLY = SessionOptions(intra_op_threads=2, provider_preference=("CPUExecutionProvider",))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_converted("dlib_resnet_v1", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def embedder(model_path: Path) -> FaceEmbedder:
    return FaceEmbedder(model_path, CPU_ONLY)


@pytest.fixture(scope="module")
def chips(faces_dev: FacesDev) -> np.ndarray:
    """One aligned 150x150 chip per identity photo where dlib's HOG detector finds a face."""
    detector = dlib.get_frontal_face_detector()
    predictor = dlib.shape_predictor(str(weights.resolve("dlib_shape5")))
    found = []
    for labelled in faces_dev.of_kind("identity"):
        image = np.asarray(Image.open(labelled.path).convert("RGB"), dtype=np.uint8)
        boxes = detector(image, 1)
        if len(boxes) == 0:
            continue
        box = max(boxes, key=lambda rect: rect.area())
        found.append(dlib.get_face_chip(image, predictor(image, box), size=150, padding=0.25))
    assert len(found) >= 10, f"only {len(found)} identity photos gave a face chip"
    return np.stack(found).astype(np.uint8)


@pytest.fixture(scope="module")
def dlib_descriptors(chips: np.ndarray) -> np.ndarray:
    recognizer = dlib.face_recognition_model_v1(str(weights.resolve("dlib_resnet_v1")))
    return np.array([recognizer.compute_face_descriptor(chip) for chip in chips], dtype=np.float64)


def test_parity_with_dlib(embedder: FaceEmbedder, chips: np.ndarray, dlib_descriptors: np.ndarray) -> None:
    ours = embedder.embed(chips)
    assert ours.dtype == np.float32 and ours.shape == (len(chips), 128)
    difference = float(np.abs(ours.astype(np.float64) - dlib_descriptors).max())
    assert difference <= 1e-4, f"max abs difference from dlib {difference:.3g}"
    # Guard against a degenerate pass (e.g. both near zero): dlib descriptors have norms around 1.4-1.6.
    assert np.all(np.linalg.norm(dlib_descriptors, axis=1) > 1.0)
    assert np.abs(dlib_descriptors).max() > 0.1


def test_batch_equals_one_by_one(embedder: FaceEmbedder, chips: np.ndarray) -> None:
    batched = embedder.embed(chips)
    singles = np.concatenate([embedder.embed(chips[i : i + 1]) for i in range(len(chips))])
    np.testing.assert_allclose(batched, singles, rtol=0, atol=1e-5)


def test_distinct_faces_give_distinct_descriptors(embedder: FaceEmbedder, chips: np.ndarray) -> None:
    descriptors = embedder.embed(chips)
    distances = np.linalg.norm(descriptors[:, None] - descriptors[None], axis=-1)
    off_diagonal = distances[~np.eye(len(chips), dtype=bool)]
    assert off_diagonal.max() > 0.6  # ten different people are in the set


def test_empty_batch(embedder: FaceEmbedder) -> None:
    out = embedder.embed(np.zeros((0, 150, 150, 3), np.uint8))
    assert out.shape == (0, 128) and out.dtype == np.float32


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((1, 150, 150, 3), np.float32),
        np.zeros((150, 150, 3), np.uint8),
        np.zeros((1, 3, 150, 150), np.uint8),
    ],
)
def test_rejects_wrong_chip_layout(embedder: FaceEmbedder, bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="uint8"):
        embedder.embed(bad)


def test_model_version_is_v2() -> None:
    # v1 ("dlib_resnet_v1", 128-d dlib descriptors) vectors live in their own Milvus collection.
    assert MODEL_VERSION == "face_v2_dlib_sface"


def test_graph_has_dynamic_batch(model_path: Path) -> None:
    model = onnx.load(str(model_path), load_external_data=False)
    (graph_input,) = model.graph.input
    (graph_output,) = model.graph.output
    assert graph_input.name == "chips" and graph_output.name == "descriptors"
    in_dims = graph_input.type.tensor_type.shape.dim
    assert in_dims[0].dim_param and [d.dim_value for d in in_dims[1:]] == [150, 150, 3]
    assert max(opset.version for opset in model.opset_import if opset.domain in ("", "ai.onnx")) >= 17


def test_converter_rejects_a_different_topology() -> None:
    net = read_dnn(weights.resolve("dlib_resnet_v1"))
    missing_relu = dataclasses.replace(net, layers=net.layers[:2] + net.layers[3:])
    with pytest.raises(ModelFormatError, match="expected ReluLayer"):
        build_descriptor_model(missing_relu)
    extra = dataclasses.replace(net, layers=(*net.layers, net.layers[2]))
    with pytest.raises(ModelFormatError, match="extra layers"):
        build_descriptor_model(extra)

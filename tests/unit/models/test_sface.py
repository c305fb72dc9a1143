"""SFace converted by model_build.sface against ONNX Runtime on the shipped quantised graph; v2's fusion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image, ImageOps

from model_build.fetch import ensure_converted
from model_build.sface import build_sface_model
from models import weights
from models.calibration import FaceScoreCalibration
from models.chips import aligned_chips
from models.detector import DetectorOptions, FaceDetector
from models.embedder import FUSED_DIM, SFaceEmbedder, fuse_vectors, unit_rows
from models.errors import ModelFormatError
from models.sessions import SessionOptions
from tests.faces_dev import FacesDev

CPU_ONLY = SessionOptions(intra_op_threads=2, provider_preference=("CPUExecutionProvider",))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_converted("sface_2021dec_int8bq", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def chips(faces_dev: FacesDev) -> np.ndarray:
    """ArcFace-aligned 112 px chips of the largest face of each identity photo."""
    detector = FaceDetector(weights.resolve("yunet_2023mar_int8bq"), DetectorOptions(), CPU_ONLY)
    out = []
    for item in faces_dev.of_kind("identity")[:12]:
        with Image.open(item.path) as image:
            rgb = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
        face = max(detector.detect([rgb])[0], key=lambda found: found.area)
        out.append(aligned_chips(rgb, [face.landmarks])[0])
    return np.stack(out)


def _reference_session() -> ort.InferenceSession:
    """The file as shipped; it declares unused float-weight inputs, which are fed zeros."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        str(weights.resolve("sface_2021dec_int8bq")), options, ["CPUExecutionProvider"]
    )


def test_converted_graph_matches_the_quantised_original_at_batch_1(
    model_path: Path, chips: np.ndarray
) -> None:
    reference = _reference_session()
    converted = SFaceEmbedder(model_path, CPU_ONLY)
    batch = converted.embed(chips)  # the whole batch at once: the batch dimension is dynamic
    assert batch.shape == (len(chips), 128)
    for index, chip in enumerate(chips):
        feed = {
            node.name: np.zeros([d if isinstance(d, int) else 1 for d in node.shape], np.float32)
            for node in reference.get_inputs()
        }
        feed["data"] = chip[None].transpose(0, 3, 1, 2).astype(np.float32)
        (raw,) = reference.run(["fc1"], feed)
        expected = unit_rows(raw)[0]
        np.testing.assert_allclose(batch[index], expected, atol=1e-5)


def test_same_person_is_closer_than_different_people(
    chips: np.ndarray, faces_dev: FacesDev, model_path: Path
) -> None:
    identities = [item.identity for item in faces_dev.of_kind("identity")[:12]]
    vectors = SFaceEmbedder(model_path, CPU_ONLY).embed(chips)
    sims = vectors @ vectors.T
    same = [sims[i, j] for i in range(len(chips)) for j in range(i) if identities[i] == identities[j]]
    different = [sims[i, j] for i in range(len(chips)) for j in range(i) if identities[i] != identities[j]]
    assert same and different
    assert min(same) > max(different)


def test_converted_graph_takes_uint8_chips_at_any_batch(model_path: Path) -> None:
    assert model_path.name == weights.CONVERTED["sface_2021dec_int8bq"].file_name
    graph = onnx.load(str(model_path)).graph
    assert [node.name for node in graph.input] == ["chips"]
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    assert not any(node.op_type == "DequantizeLinear" for node in graph.node)
    # PRelu is rewritten into ops ONNX Runtime runs in its blocked layout (model_build.sface); the graph still
    # matches the shipped one (test_converted_graph_matches_the_quantised_original_at_batch_1).
    assert not any(node.op_type == "PRelu" for node in graph.node)


def test_converter_refuses_another_graph() -> None:
    other = onnx.load(str(weights.resolve("yunet_2023mar_int8bq")))
    with pytest.raises(ModelFormatError):
        build_sface_model(other)


def test_fused_vectors_are_unit_length_and_weight_the_two_cosines() -> None:
    rng = np.random.default_rng(0)
    a_dlib, b_dlib, a_sface, b_sface = (unit_rows(rng.normal(size=(1, 128))) for _ in range(4))
    weights_pair = FaceScoreCalibration.load().fusion_weights
    assert weights_pair is not None
    a = fuse_vectors(a_dlib, a_sface, weights_pair)
    b = fuse_vectors(b_dlib, b_sface, weights_pair)
    assert a.shape == (1, FUSED_DIM)
    assert float(np.linalg.norm(a)) == pytest.approx(1.0, abs=1e-6)
    w_d, w_s = weights_pair
    expected = (w_d**2 * (a_dlib @ b_dlib.T).item() + w_s**2 * (a_sface @ b_sface.T).item()) / (
        w_d**2 + w_s**2
    )
    assert (a @ b.T).item() == pytest.approx(expected, abs=1e-6)

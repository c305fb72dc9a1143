"""YuNet converted by model_build.yunet against the shipped file made runnable in memory (dev photos)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image, ImageOps

from model_build.fetch import ensure_converted
from models import weights
from models.detector import DetectorOptions, FaceDetector
from models.sessions import SessionOptions
from tests.faces_dev import FacesDev

CPU_ONE_THREAD = SessionOptions(intra_op_threads=1, provider_preference=("CPUExecutionProvider",))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from the verified source and checked against the recorded sha256 (ensure_converted raises
    # otherwise), so the converter is deterministic.
    return ensure_converted("yunet_2023mar_int8bq", tmp_path_factory.mktemp("models"))


def test_the_converted_graph_is_plain_float_with_uint8_input(model_path: Path) -> None:
    model = onnx.load(str(model_path))
    ops = Counter(node.op_type for node in model.graph.node)
    assert ops["DequantizeLinear"] == 0
    constants = {tensor.name for tensor in model.graph.initializer}
    # Every Conv reads its weights straight from an initializer (no Reshape in between).
    assert all(node.input[1] in constants for node in model.graph.node if node.op_type == "Conv")
    assert ops["Conv"] == 53
    assert all(
        tensor.data_type == onnx.TensorProto.FLOAT
        for tensor in model.graph.initializer
        if tensor.name.endswith("weight") or tensor.name.endswith("bias")
    )
    (image_input,) = model.graph.input
    assert image_input.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert [d.dim_param for d in image_input.type.tensor_type.shape.dim] == ["batch", "", "height", "width"]


def test_same_faces_and_boxes_within_a_pixel_on_every_dev_photo(
    model_path: Path, faces_dev: FacesDev
) -> None:
    shipped = FaceDetector(weights.resolve("yunet_2023mar_int8bq"), DetectorOptions(), CPU_ONE_THREAD)
    converted = FaceDetector(model_path, DetectorOptions(), CPU_ONE_THREAD)
    images = []
    for item in faces_dev.images:
        with Image.open(item.path) as image:
            images.append(np.asarray(ImageOps.exif_transpose(image).convert("RGB")))
    assert len(images) == len(faces_dev.images) > 90
    before, after = shipped.detect(images), converted.detect(images)
    assert sum(map(len, before)) >= 100  # 100 faces measured on the 97 photos
    for old, new in zip(before, after, strict=True):
        assert len(new) == len(old)
        for a, b in zip(old, new, strict=True):
            np.testing.assert_allclose(b.box, a.box, atol=1.0)
            np.testing.assert_allclose(b.landmarks, a.landmarks, atol=1.0)
            assert b.score == pytest.approx(a.score, abs=1e-3)


def test_batches_of_uint8_letterboxes_match_one_at_a_time(model_path: Path, faces_dev: FacesDev) -> None:
    converted = FaceDetector(model_path, DetectorOptions(), CPU_ONE_THREAD)
    group = [item for item in faces_dev.of_kind("group")][:3]
    images = []
    for item in group:
        with Image.open(item.path) as image:
            images.append(np.asarray(ImageOps.exif_transpose(image).convert("RGB")))
    prepared = [converted.prepare(image) for image in images]
    converted.images_per_run = len(prepared)  # the whole batch in one run, as on a GPU
    together = converted.detect_prepared(prepared)
    alone = [converted.detect_prepared([item])[0] for item in prepared]
    for a, b in zip(alone, together, strict=True):
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x.box, y.box, atol=1e-3)

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from PIL import Image, ImageOps

from bench.age_v1 import (
    AGE_CHIP_PADDINGS,
    AGE_CLASS_VALUES,
    AGE_VIEWS_PER_FACE,
    DEFAULT_MINOR_POLICY,
    AgeEstimator,
    MinorPolicy,
    age_chip_views,
    age_v1_path,
    flush_denormal_weights,
    round_age,
)
from models.align import FaceAligner
from models.arrays import to_rgb
from models.detector import DetectorOptions, FaceDetector
from models.errors import ModelFormatError
from models.sessions import SessionOptions
from models.weights import resolve
from tests.faces_dev import FacesDev

# age-v1 is no longer the service's age model (models/age_v2.py); bench/age_v1.py keeps it loadable so that
# bench/age.py can compare the two. These tests keep its runner honest.


@pytest.fixture(scope="module")
def estimator() -> AgeEstimator:
    return AgeEstimator(age_v1_path(), SessionOptions(intra_op_threads=1))


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


@pytest.fixture(scope="module")
def dev_views(faces_dev: FacesDev) -> np.ndarray:
    """Age views [8, V, 64, 64, 3] of eight real faces, spread over the age range (age-v1's recipe)."""
    options = SessionOptions(intra_op_threads=1)
    detector = FaceDetector(resolve("yunet_2023mar_int8bq"), DetectorOptions(), options)
    aligner = FaceAligner(resolve("dlib_shape5"))
    chips = []
    for item in faces_dev.of_kind("age")[::8]:
        image = to_rgb(_pixels(item.path))
        faces = detector.detect([image])[0]
        shapes = aligner.shapes(image, faces[:1])
        per_padding = [aligner.chips(image, shapes, 64, pad) for pad in AGE_CHIP_PADDINGS]
        chips.append(age_chip_views(per_padding)[0])
    return np.stack(chips)


def test_batch_equals_one_by_one(estimator: AgeEstimator, dev_views: np.ndarray) -> None:
    batched = estimator.estimate(dev_views)
    single = [estimator.estimate(dev_views[i : i + 1])[0] for i in range(len(dev_views))]
    assert len(batched) == len(single) == len(dev_views)
    for a, b in zip(batched, single, strict=True):
        assert a.expected_age == pytest.approx(b.expected_age, abs=1e-3)
        assert a.p_under_18 == pytest.approx(b.p_under_18, abs=1e-5)
        assert (a.age, a.under_18, a.under_21) == (b.age, b.under_18, b.under_21)


def test_views_are_averaged_as_distributions(estimator: AgeEstimator, dev_views: np.ndarray) -> None:
    averaged = estimator.probabilities(dev_views)
    per_view = [estimator.probabilities(dev_views[:, v]) for v in range(dev_views.shape[1])]
    np.testing.assert_allclose(averaged, np.mean(per_view, axis=0), atol=1e-6)
    # A single chip per face ([N, 64, 64, 3]) is the same as one view ([N, 1, 64, 64, 3]).
    np.testing.assert_allclose(estimator.probabilities(dev_views[:, 0]), per_view[0], atol=1e-7)


def test_estimates_come_from_the_distribution(estimator: AgeEstimator, dev_views: np.ndarray) -> None:
    probabilities = estimator.probabilities(dev_views)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-3)
    assert probabilities.min() >= 0.0
    for row, estimate in zip(probabilities, estimator.estimate(dev_views), strict=True):
        assert estimate.expected_age == pytest.approx(float(row @ AGE_CLASS_VALUES), abs=1e-3)
        assert estimate.age == round_age(estimate.expected_age)
        assert 0.25 <= estimate.expected_age <= 80.0
        assert 0.0 <= estimate.p_under_18 <= estimate.p_under_21 <= 1.0
        assert estimate.p_under_18 == pytest.approx(float(row[:18].sum()), abs=1e-4)
        # Being under 18 implies being under 21, so the labels can never say otherwise.
        assert estimate.under_18 <= estimate.under_21


def test_age_chip_views_adds_mirror_images() -> None:
    rng = np.random.default_rng(0)
    per_padding = [rng.integers(0, 256, (3, 64, 64, 3), dtype=np.uint8) for _ in AGE_CHIP_PADDINGS]
    views = age_chip_views(per_padding, mirror=True)
    assert views.shape == (3, AGE_VIEWS_PER_FACE, 64, 64, 3)
    count = len(AGE_CHIP_PADDINGS)
    for index, chips in enumerate(per_padding):
        np.testing.assert_array_equal(views[:, index], chips)
        np.testing.assert_array_equal(views[:, count + index], chips[:, :, ::-1])
    assert age_chip_views(per_padding, mirror=False).shape == (3, count, 64, 64, 3)
    with pytest.raises(ValueError):
        age_chip_views([])


def test_empty_batch(estimator: AgeEstimator) -> None:
    assert estimator.estimate(np.zeros((0, AGE_VIEWS_PER_FACE, 64, 64, 3), dtype=np.uint8)) == []
    assert estimator.estimate(np.zeros((0, 64, 64, 3), dtype=np.uint8)) == []


@pytest.mark.parametrize(
    "chips",
    [
        np.zeros((2, 64, 64, 3), dtype=np.float32),
        np.zeros((2, 32, 32, 3), dtype=np.uint8),
        np.zeros((2, 64, 64), dtype=np.uint8),
        np.zeros((2, 0, 64, 64, 3), dtype=np.uint8),
    ],
)
def test_rejects_malformed_chips(estimator: AgeEstimator, chips: np.ndarray) -> None:
    with pytest.raises(ValueError):
        estimator.estimate(chips)


def test_rejects_a_model_that_is_not_the_age_network(tmp_path: Path) -> None:
    wrong = tmp_path / "identity.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "not-age",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 64, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what this onnxruntime reads; the onnx package writes a newer one by default
    onnx.save(model, str(wrong))
    with pytest.raises(ModelFormatError):
        AgeEstimator(wrong, SessionOptions())
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ModelFormatError):
        AgeEstimator(garbage, SessionOptions())


def test_flush_denormal_weights_only_touches_denormals() -> None:
    values = np.array([1e-40, -1e-41, 0.0, 1e-37, -2.5, np.finfo(np.float32).tiny], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])],
        initializer=[onnx.numpy_helper.from_array(values, "w")],
    )
    model = helper.make_model(graph)
    assert flush_denormal_weights(model) == 2
    flushed = onnx.numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_array_equal(flushed, np.array([0, 0, 0, 1e-37, -2.5, values[5]], dtype=np.float32))


# Default policy: 100 below 16 (under_18) / 19 (under_21), 0 from 34 / 37 unless P(under) >= 0.25.
@pytest.mark.parametrize(
    ("expected_age", "p_under", "limit", "value"),
    [
        (5.0, 1.0, 18, 100),
        (15.99, 0.9, 18, 100),
        (16.0, 0.9, 18, 50),
        (17.9, 0.5, 18, 50),
        (25.0, 0.0, 18, 50),
        (33.99, 0.0, 18, 50),
        (34.0, 0.0, 18, 0),
        (34.0, 0.24, 18, 0),
        (34.0, 0.25, 18, 50),  # a spread-out distribution with real mass below 18 is never "adult"
        (70.0, 0.0, 18, 0),
        (18.99, 0.9, 21, 100),
        (19.0, 0.9, 21, 50),
        (36.99, 0.0, 21, 50),
        (37.0, 0.01, 21, 0),
        (45.0, 0.3, 21, 50),
    ],
)
def test_default_policy_table(expected_age: float, p_under: float, limit: int, value: int) -> None:
    policy = DEFAULT_MINOR_POLICY
    label = policy.under_18(expected_age, p_under) if limit == 18 else policy.under_21(expected_age, p_under)
    assert label == value


def test_custom_policy_margins() -> None:
    policy = MinorPolicy(minor_margin=0.0, adult_margin=0.0, max_p_under_for_zero=1.0)
    assert policy.under_18(17.99, 1.0) == 100
    assert policy.under_18(18.0, 0.99) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"minor_margin": -1.0},
        {"adult_margin": -0.5},
        {"max_p_under_for_zero": 0.0},
        {"max_p_under_for_zero": 1.5},
    ],
)
def test_policy_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        MinorPolicy(**kwargs)


def test_round_age_rounds_half_up() -> None:
    assert [round_age(v) for v in (0.25, 0.5, 1.49, 17.5, 18.4999)] == [0, 1, 1, 18, 18]

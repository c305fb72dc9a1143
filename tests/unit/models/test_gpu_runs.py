"""Runs of one fixed size (what a GPU session gets, SessionOptions.gpu_run_size) give the same answers as
runs of any size: the padding never leaks into a result. The sessions run on this CPU; only the decision to
pad is made as on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import models.age_v2
import models.detector
import models.embedder
from models.age_v2 import INPUT_SIZE as AGE_SIZE
from models.age_v2 import VIEWS_PER_FACE
from models.analyzer import ModelConfig
from models.chips import CHIP_SIZE as SFACE_CHIP_SIZE
from models.embedder import CHIP_SIZE
from models.sessions import SessionOptions
from tests.faces_dev import FacesDev


@pytest.fixture(autouse=True)
def pad_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def configured(session: object, options: SessionOptions) -> int:
        return options.gpu_run_size

    for module in (models.embedder, models.age_v2, models.detector):
        monkeypatch.setattr(module, "fixed_run_size", configured)


def pixels(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_descriptors_do_not_depend_on_the_run_size() -> None:
    dlib_chips, sface_chips = (
        pixels((5, CHIP_SIZE, CHIP_SIZE, 3), 1),
        pixels((5, SFACE_CHIP_SIZE, SFACE_CHIP_SIZE, 3), 2),
    )
    any_size = ModelConfig(gpu_face_run_size=0).load_embedder().embed(dlib_chips, sface_chips)
    runs_of_4 = ModelConfig(gpu_face_run_size=4).load_embedder().embed(dlib_chips, sface_chips)
    assert runs_of_4.shape == any_size.shape == (5, any_size.shape[1])
    np.testing.assert_allclose(runs_of_4, any_size, atol=1e-5)


def test_ages_do_not_depend_on_the_run_size() -> None:
    views = pixels((3, VIEWS_PER_FACE, AGE_SIZE, AGE_SIZE, 3), 3)
    any_size = ModelConfig(gpu_face_run_size=0).load_age_estimator().probabilities(views)
    runs_of_2 = ModelConfig(gpu_face_run_size=2).load_age_estimator().probabilities(views)
    np.testing.assert_allclose(runs_of_2, any_size, atol=1e-6)


def test_detections_do_not_depend_on_the_run_size(faces_dev: FacesDev) -> None:
    images = [np.asarray(Image.open(item.path).convert("RGB")) for item in faces_dev.of_kind("group")[:3]]
    any_size = ModelConfig(gpu_image_run_size=0).load_detector().detect(images)
    runs_of_2 = ModelConfig(gpu_image_run_size=2).load_detector().detect(images)
    assert sum(map(len, any_size)) > 3  # real faces, so the comparison means something
    assert [len(faces) for faces in runs_of_2] == [len(faces) for faces in any_size]
    for padded, plain in zip(runs_of_2, any_size, strict=True):
        for a, b in zip(padded, plain, strict=True):
            np.testing.assert_allclose(a.box, b.box, atol=1e-3)

"""The split (GPU) topology's analysis: what crosses each handle, and which models a request runs."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

from models.analyzer import ModelConfig
from models.embedder import FUSED_DIM
from models.runners import DescriptorChips, pair, unpair
from serve_app.deployments.analysis import SplitAnalysis
from tests.faces_dev import FacesDev


class _Method:
    """Stands in for `handle.method` with the `.remote(...)` awaitable of a Ray handle."""

    def __init__(self, name: str, calls: list[tuple[str, Any]], answer: Any) -> None:
        self._name, self._calls, self._answer = name, calls, answer

    async def remote(self, payload: Any) -> Any:
        self._calls.append((self._name, payload))
        await asyncio.sleep(0)
        return self._answer(payload)


class _Handle:
    def __init__(self, **methods: _Method) -> None:
        for name, method in methods.items():
            setattr(self, name, method)


@pytest.fixture(scope="module")
def photo(faces_dev: FacesDev) -> np.ndarray:
    with Image.open(faces_dev.of_kind("identity")[0].path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


def test_only_the_needed_deployments_are_called_with_aligned_chips(photo: np.ndarray) -> None:
    config = ModelConfig()
    detector = config.load_detector()
    calls: list[tuple[str, Any]] = []
    handles = {
        "detector": _Handle(run=_Method("detect", calls, lambda boxed: detector.detect_prepared([boxed])[0])),
        "embedder": _Handle(
            run=_Method("embed", calls, lambda chips: np.zeros((len(chips.dlib), FUSED_DIM), np.float32))
        ),
        "age": _Handle(run=_Method("estimate", calls, lambda chips: [None] * len(chips))),
    }
    split = SplitAnalysis(handles["detector"], handles["embedder"], handles["age"], {})  # type: ignore[arg-type]

    faces = asyncio.run(split.analyze(photo, embed=True, estimate_age=False))
    assert faces and all(face.embedding is not None and face.quality is not None for face in faces)
    assert [name for name, _ in calls] == ["detect", "embed"]  # face search: no age model
    chips = calls[1][1]
    assert isinstance(chips, DescriptorChips)
    assert (
        chips.dlib is not None
        and chips.dlib.shape[1:] == (150, 150, 3)
        and chips.sface.shape[1:] == (112, 112, 3)
    )
    assert chips.dlib.dtype == chips.sface.dtype == np.uint8

    calls.clear()
    faces = asyncio.run(split.analyze(photo, embed=False, estimate_age=True))
    assert [name for name, _ in calls] == ["detect", "estimate"]  # age without enrolment: no embedder
    assert all(face.embedding is None for face in faces)


def test_paired_chips_round_trip() -> None:
    rng = np.random.default_rng(0)
    chips = DescriptorChips(
        rng.integers(0, 256, (3, 150, 150, 3), dtype=np.uint8),
        rng.integers(0, 256, (3, 112, 112, 3), dtype=np.uint8),
    )
    dlib, sface = unpair(pair(chips))
    np.testing.assert_array_equal(dlib, chips.dlib)
    np.testing.assert_array_equal(sface, chips.sface)

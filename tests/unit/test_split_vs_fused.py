"""The split (GPU) topology's analysis gives the same faces, descriptors and ages as the fused analyzer.

The three deployment handles are stood in for by objects whose `.method.remote(...)` runs the real model
runner from models/ in process (no Ray): what is tested is SplitAnalysis's own work, cutting crops,
asking only for what the transaction needs, and handing each answer back to its face.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

from models.age_policy import age_faces
from models.analyzer import ModelConfig, largest_face, load_face_analyzer
from models.runners import AgeRunner, AnalysisRequest, AnalysisRunner, DetectorRunner, EmbedderRunner
from serve_app.deployments.analysis import SplitAnalysis
from tests.faces_dev import FacesDev


class _Method:
    def __init__(self, function: Callable[[Any], Any], calls: list[str], name: str) -> None:
        self._function, self._calls, self._name = function, calls, name

    async def remote(self, argument: Any) -> Any:
        self._calls.append(self._name)
        return self._function(argument)


class _Handle:
    """A deployment handle: every model deployment answers on `run` (serve_app.deployments.models)."""

    def __init__(self, name: str, function: Callable[[Any], Any], calls: list[str]) -> None:
        self.run = _Method(function, calls, name)


def _stand_in(name: str, function: Callable[[Any], Any], calls: list[str]) -> Any:
    """Typed Any: SplitAnalysis wants a DeploymentHandle, and the stand-in has only its `run.remote`."""
    return _Handle(name, function, calls)


@pytest.fixture(scope="module")
def setup() -> tuple[SplitAnalysis, Any, list[str]]:
    config = ModelConfig(intra_op_threads=1)
    analyzer = load_face_analyzer(config)
    calls: list[str] = []
    # The stand-ins run the same runners as the model deployments; descriptor runs of one face each, so a
    # group photo's chips are cut into runs and put back together.
    detector, embedder, age = (
        DetectorRunner(analyzer.detector),
        EmbedderRunner(analyzer.embedder),
        AgeRunner(analyzer.age_estimator),
    )
    split = SplitAnalysis(
        detector=_stand_in("detect", lambda item: detector.run([item], 64)[0], calls),
        embedder=_stand_in("embed", lambda chips: embedder.run([chips], 1)[0], calls),
        age=_stand_in("estimate", lambda views: age.run([views], 64)[0], calls),
        model_config={"intra_op_threads": 1},
    )
    return split, analyzer, calls


def _pixels(path: Any) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


def test_split_matches_fused_on_a_group_photo(
    faces_dev: FacesDev, setup: tuple[SplitAnalysis, Any, list[str]]
) -> None:
    split, analyzer, calls = setup
    image = _pixels(faces_dev.of_kind("group")[0].path)
    calls.clear()
    faces = asyncio.run(split.analyze(image, embed=True, estimate_age=True))
    (fused,) = analyzer.analyze([image])
    assert len(faces) == len(fused) >= 2
    subject = largest_face(faces)
    assert subject is not None and subject.age is not None
    estimated = age_faces([face.detection for face in faces])
    assert len(estimated) >= 2  # faces of comparable size are estimated too
    for index, (a, b) in enumerate(zip(faces, fused, strict=True)):
        np.testing.assert_allclose(a.detection.box, b.detection.box, atol=0.05)
        assert a.embedding is not None and b.embedding is not None
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-4)
        # The subject and the faces the age rules need carry an age, the same in both topologies.
        assert (a.age is None) == (b.age is None) == (index not in estimated)
        if a.age is not None and b.age is not None:
            assert a.age.expected_age == pytest.approx(b.age.expected_age, abs=1e-3)
            assert a.age.p_under_18 == pytest.approx(b.age.p_under_18, abs=1e-3)
    assert sorted(calls) == ["detect", "embed", "estimate"]


def test_split_age_without_enrolment_asks_no_descriptor(
    faces_dev: FacesDev, setup: tuple[SplitAnalysis, Any, list[str]]
) -> None:
    split, _, calls = setup
    image = _pixels(faces_dev.of_kind("age")[0].path)
    calls.clear()
    faces = asyncio.run(split.analyze(image, embed=False, estimate_age=True))
    assert faces and all(face.embedding is None for face in faces)
    assert calls == ["detect", "estimate"]
    calls.clear()
    faces = asyncio.run(split.analyze(image, embed=True, estimate_age=False))
    assert faces and all(face.age is None for face in faces)
    assert calls == ["detect", "embed"]


def test_one_analysis_batch_mixing_a_search_and_an_age_estimate(
    faces_dev: FacesDev, setup: tuple[SplitAnalysis, Any, list[str]]
) -> None:
    _, analyzer, _ = setup
    group = _pixels(faces_dev.of_kind("group")[0].path)
    crop = _pixels(faces_dev.of_kind("age")[0].path)
    search, age = AnalysisRunner(analyzer).run(
        [AnalysisRequest(group, embed=True, estimate_age=False), AnalysisRequest(crop, False, True)], 64
    )
    (fused_search,), (fused_age,) = (
        analyzer.analyze([group], True, False),
        analyzer.analyze([crop], False, True),
    )
    assert len(search) == len(fused_search) >= 2 and len(age) == len(fused_age) >= 1
    assert all(face.age is None and face.embedding is not None for face in search)
    subject = largest_face(age)
    assert all(face.embedding is None for face in age) and subject is not None and subject.age is not None
    for a, b in zip(search, fused_search, strict=True):
        assert a.embedding is not None and b.embedding is not None
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-4)

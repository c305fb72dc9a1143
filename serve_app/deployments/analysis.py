"""The worker's analysis backends (serve_app.pipelines.analysis.FaceAnalysisBackend), one per topology, and
the small picklable recipes the topology binds into the worker (serve_app.launch.topology). A recipe is
built in the worker's replica, so the models load there and never travel through Ray:

- OwnModels (CPU, one machine): the worker owns the models; concurrent transactions are batched into
  AnalysisRunner runs in the worker's own process, without a handle hop (ModelAnalysis).
- ModelDeployments (GPU cluster): FaceAnalyzer's stages across the model deployments, one per stage that
  models.registry gives a deployment (SplitAnalysis). The worker letterboxes and aligns locally, so only
  fixed-size arrays cross the handles: a uint8 640x640 letterboxed image to the detector, 150 px (dlib)
  and 112 px (SFace) chips to the embedder, and the subject's 224 px views to the age model. Each model
  runs only when the transaction needs it (face search: no age model; age estimation: embedders only when
  enrolling), and the answers are put together by FaceAnalyzer.assemble, as in one process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from ray.serve.handle import DeploymentHandle

from models.analyzer import FaceAnalyzer, FaceCrops, FaceResults
from models.registry import Stage
from models.runners import AnalysisRequest, DescriptorChips
from models.types import AgeEstimate, AnalyzedFace, DetectedFace
from serve_app.deployments.models import RunnerBatcher
from serve_app.settings import Settings
from serve_app.wiring.models import model_config as with_face_model


class WorkerAnalysis(Protocol):
    """What the worker analyses with: FaceAnalysisBackend, plus its part of the replica's health check."""

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]: ...

    async def check(self) -> None:
        """Raise when the models this replica owns cannot run (a replica that owns none has nothing to do)."""


class AnalysisRecipe(Protocol):
    """Bound into the worker by the topology; built once in the worker's replica."""

    def build(self) -> WorkerAnalysis: ...


class ModelAnalysis:
    """The analysis runner in this process, batched across the worker's concurrent transactions, with up to
    `concurrent_batches` batches running at once."""

    def __init__(self, model_config: dict[str, Any], concurrent_batches: int = 1) -> None:
        self._batcher = RunnerBatcher("analysis", model_config, concurrent_batches)

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        faces: list[AnalyzedFace] = await self._batcher.run(AnalysisRequest(image, embed, estimate_age))
        return faces

    async def check(self) -> None:
        await self._batcher.check()


class SplitAnalysis:
    def __init__(
        self,
        detector: DeploymentHandle[Any],
        embedder: DeploymentHandle[Any],
        age: DeploymentHandle[Any],
        model_config: dict[str, Any],
    ) -> None:
        config = with_face_model(model_config, Settings())
        self._detector = detector
        self._embedder = embedder
        self._age = age
        self._letterbox = config.letterboxer()
        self._cropper = config.load_cropper()

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        letterboxed = await asyncio.to_thread(self._letterbox, image)
        faces: list[DetectedFace] = await self._detector.run.remote(letterboxed)
        if not faces:
            return []
        crops = await asyncio.to_thread(self._cropper, image, faces, embed, estimate_age)
        embeddings, ages = await asyncio.gather(self._embeddings(crops), self._ages(crops))
        results = FaceResults(embeddings=embeddings, ages=ages, age_faces=crops.age_faces)
        return FaceAnalyzer.assemble(faces, results, crops.qualities)

    async def check(self) -> None:
        """The model deployments check their own models."""

    async def _embeddings(self, crops: FaceCrops) -> np.ndarray | None:
        if crops.sface_chips is None:
            return None
        rows: np.ndarray = await self._embedder.run.remote(
            DescriptorChips(crops.descriptor_chips, crops.sface_chips)
        )
        return rows

    async def _ages(self, crops: FaceCrops) -> list[AgeEstimate] | None:
        if crops.age_views is None:
            return None
        return list(await self._age.run.remote(crops.age_views))


@dataclass(frozen=True)
class OwnModels:
    """The worker owns the models (the one-machine CPU topology)."""

    model_config: dict[str, Any] = field(default_factory=dict)
    concurrent_batches: int = 1

    def build(self) -> WorkerAnalysis:
        return ModelAnalysis(self.model_config, self.concurrent_batches)


@dataclass(frozen=True)
class ModelDeployments:
    """The models run in their own deployments (the split topology): one handle per stage that has one
    (models.registry); Serve turns the bound deployments into handles in the worker's replica."""

    handles: Mapping[Stage, DeploymentHandle[Any]]
    model_config: dict[str, Any] = field(default_factory=dict)

    def build(self) -> WorkerAnalysis:
        handles = self.handles
        return SplitAnalysis(handles["detector"], handles["embedder"], handles["age"], self.model_config)

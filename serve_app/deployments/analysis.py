"""The worker's analysis backends (serve_app.pipelines.analysis.FaceAnalysisBackend), one per wiring of the
same analysis:

- FusedAnalysis: one hop to FaceAnalysisModel, which runs FaceAnalyzer.analyze_each in its replica.
- InProcessAnalysis (CPU topology `in_process`): the worker owns the models; concurrent transactions are
  batched into AnalysisRunner runs in the worker's own process, without a handle hop.
- SplitAnalysis (GPU topology): FaceAnalyzer's stages across the detector, embedder and age deployments.
  The worker letterboxes and aligns locally, so only fixed-size arrays cross the handles: a uint8 640x640
  letterboxed image to the detector, 150 px (dlib) and 112 px (SFace) chips to the embedder, and the
  subject's 224 px views to the age model. Each model runs only when the transaction needs it (face search:
  no age model; age estimation: embedders only when enrolling), and the answers are put together by
  FaceAnalyzer.assemble, as in one process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from ray.serve.handle import DeploymentHandle

from models.analyzer import FaceAnalyzer, FaceCrops, FaceResults, ModelConfig
from models.runners import AnalysisRequest, DescriptorChips
from models.types import AgeEstimate, AnalyzedFace, DetectedFace
from serve_app.deployments.models import RunnerBatcher


class FusedAnalysis:
    """Analysis by the single FaceAnalysisModel deployment: one hop, the decoded image crosses it."""

    def __init__(self, handle: DeploymentHandle[Any]) -> None:
        self._handle = handle

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        faces: list[AnalyzedFace] = await self._handle.run.remote(AnalysisRequest(image, embed, estimate_age))
        return faces


class InProcessAnalysis:
    """The analysis runner in this process, batched across the worker's concurrent transactions."""

    def __init__(self, batcher: RunnerBatcher) -> None:
        self._batcher = batcher

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        faces: list[AnalyzedFace] = await self._batcher.run(AnalysisRequest(image, embed, estimate_age))
        return faces


class SplitAnalysis:
    def __init__(
        self,
        detector: DeploymentHandle[Any],
        embedder: DeploymentHandle[Any],
        age: DeploymentHandle[Any],
        model_config: dict[str, Any],
    ) -> None:
        config = ModelConfig.from_dict(model_config)
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

    async def _embeddings(self, crops: FaceCrops) -> np.ndarray | None:
        if crops.descriptor_chips is None or crops.sface_chips is None:
            return None
        rows: np.ndarray = await self._embedder.run.remote(
            DescriptorChips(crops.descriptor_chips, crops.sface_chips)
        )
        return rows

    async def _ages(self, crops: FaceCrops) -> list[AgeEstimate] | None:
        if crops.age_views is None:
            return None
        return list(await self._age.run.remote(crops.age_views))

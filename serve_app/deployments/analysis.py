"""Analysis across the separate detector, embedder and age deployments (the GPU topology).

The worker letterboxes and aligns locally, so only fixed-size arrays cross the handles: a uint8 640x640
letterboxed image to the detector, 150 px (dlib) and 112 px (SFace) chips to the embedder, and the subject's
224 px views to the age model (age runs on the largest face only). Each model runs only when the transaction
needs it (face search: no age model; age estimation: embedders only when enrolling).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from ray.serve.handle import DeploymentHandle

from models.analyzer import ModelConfig
from models.types import AnalyzedFace, DetectedFace
from serve_app.deployments.models import DescriptorChips


class SplitAnalysis:
    def __init__(
        self,
        detector: DeploymentHandle,
        embedder: DeploymentHandle,
        age: DeploymentHandle,
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
        faces: list[DetectedFace] = await self._detector.detect.remote(letterboxed)
        if not faces:
            return []
        crops = await asyncio.to_thread(self._cropper, image, faces, embed, estimate_age)
        embeddings: Any = None
        ages: Any = None
        calls = []
        if embed:
            assert crops.descriptor_chips is not None and crops.sface_chips is not None
            calls.append(
                self._embedder.embed.remote(DescriptorChips(crops.descriptor_chips, crops.sface_chips))
            )
        if estimate_age:
            calls.append(self._age.estimate.remote(crops.age_views))
        results = list(await asyncio.gather(*calls))
        if embed:
            embeddings = results.pop(0)
        if estimate_age:
            ages = dict(zip(crops.age_faces, results.pop(0), strict=True))
        return [
            AnalyzedFace(
                detection=face,
                embedding=None if embeddings is None else np.asarray(embeddings[index], dtype=np.float32),
                age=None if ages is None else ages.get(index),
                quality=crops.qualities[index] if crops.qualities else None,
            )
            for index, face in enumerate(faces)
        ]

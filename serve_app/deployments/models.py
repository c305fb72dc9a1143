"""Model deployments. Each wraps model runners from models/ and batches calls across requests.

CPU default: one FaceAnalysisModel (detect + align + embed + age in one replica) because on a 2-core box
every deployment hop costs about as much CPU as a model. GPU config: FaceDetectorModel, FaceEmbedderModel
and AgeModel as separate deployments with fractional GPUs so each scales on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from ray import serve

from models.analyzer import FaceAnalyzer, ModelConfig, load_face_analyzer
from models.chips import CHIP_SIZE as SFACE_CHIP_SIZE
from models.convert import CHIP_SIZE as DLIB_CHIP_SIZE
from models.embedder import FUSED_DIM
from models.types import AnalyzedFace, DetectedFace
from serve_app.deploy_config import BatchConfig
from serve_app.deployments.metrics import ModelMetrics

logger = logging.getLogger(__name__)
_Result = TypeVar("_Result")


class InferenceLane:
    """Runs a replica's blocking inference in a worker thread, one call at a time.

    Off the event loop, the replica keeps receiving requests while a batch computes, so the next batch is
    assembled in the meantime instead of after it (ONNX Runtime releases the GIL while it runs).
    One at a time, because health checks share the models with the batches."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def run(self, function: Callable[..., _Result], *args: Any) -> _Result:
        async with self._lock:
            return await asyncio.to_thread(function, *args)


@dataclass(frozen=True)
class AnalysisRequest:
    image: np.ndarray  # uint8 RGB
    embed: bool
    estimate_age: bool


def _strip(face: AnalyzedFace, request: AnalysisRequest) -> AnalyzedFace:
    return AnalyzedFace(
        detection=face.detection,
        embedding=face.embedding if request.embed else None,
        age=face.age if request.estimate_age else None,
        quality=face.quality,
    )


_DLIB_SHAPE = (DLIB_CHIP_SIZE, DLIB_CHIP_SIZE, 3)
_DLIB_BYTES = DLIB_CHIP_SIZE * DLIB_CHIP_SIZE * 3
_SFACE_SHAPE = (SFACE_CHIP_SIZE, SFACE_CHIP_SIZE, 3)


def _pair(chips: DescriptorChips) -> np.ndarray:
    """[F, 150*150*3 + 112*112*3] uint8: each face's two chips side by side, flattened."""
    count = len(chips.dlib)
    if len(chips.sface) != count:
        raise ValueError(f"{count} dlib chips but {len(chips.sface)} SFace chips")
    return np.concatenate([chips.dlib.reshape(count, -1), chips.sface.reshape(count, -1)], axis=1)


def _unpair(paired: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    count = len(paired)
    dlib = np.ascontiguousarray(paired[:, :_DLIB_BYTES]).reshape(count, *_DLIB_SHAPE)
    sface = np.ascontiguousarray(paired[:, _DLIB_BYTES:]).reshape(count, *_SFACE_SHAPE)
    return dlib, sface


def _apply_batch_config(config: BatchConfig, *methods: Any) -> None:
    for method in methods:
        method.set_max_batch_size(config.max_batch_size)
        method.set_batch_wait_timeout_s(config.batch_wait_timeout_s)


def _in_runs(chip_sets: Sequence[np.ndarray], run_size: int, infer: Callable[[np.ndarray], Any]) -> list[Any]:
    """Concatenate the chips of all requests, run the model in runs of at most run_size faces, and split the
    outputs back per request: batches are sized by faces, not by requests."""
    counts = [len(chips) for chips in chip_sets]
    if sum(counts) == 0:
        return [infer(chip_set) for chip_set in chip_sets]
    stacked = np.concatenate([chips for chips in chip_sets if len(chips)], axis=0)
    outputs: list[Any] = []
    for start in range(0, len(stacked), run_size):
        part = infer(stacked[start : start + run_size])
        outputs.extend(list(part))
    results: list[Any] = []
    offset = 0
    for count in counts:
        results.append(outputs[offset : offset + count])
        offset += count
    return results


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, ray_actor_options={"num_cpus": 1})
class FaceAnalysisModel:
    """Detection, alignment, descriptor and age in one process, batched over images."""

    def __init__(self, model_config: dict[str, Any] | None = None) -> None:
        self._analyzer: FaceAnalyzer = load_face_analyzer(ModelConfig.from_dict(model_config or {}))
        self._lane = InferenceLane()
        self._metrics = ModelMetrics("analysis")
        _apply_batch_config(BatchConfig(), self.analyze_batch)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        _apply_batch_config(BatchConfig.model_validate(user_config or {}), self.analyze_batch)

    async def analyze(self, request: AnalysisRequest) -> list[AnalyzedFace]:
        return await self.analyze_batch(request)

    @serve.batch  # sizes: BatchConfig, applied in __init__ and reconfigure
    async def analyze_batch(self, requests: list[AnalysisRequest]) -> list[list[AnalyzedFace]]:
        started = time.perf_counter()
        # One detector run over all images, one descriptor run and one age run over the faces of the
        # requests that need each (a face search never runs the age model, an age estimate without
        # enrolment never runs the embedders, even when they share a batch).
        images = [request.image for request in requests]
        needs = [(request.embed, request.estimate_age) for request in requests]
        per_image = await self._lane.run(self._analyzer.analyze_each, images, needs)
        faces = sum(len(found) for found in per_image)
        self._metrics.observe_batch(len(requests), faces, time.perf_counter() - started)
        return [
            [_strip(face, request) for face in found]
            for found, request in zip(per_image, requests, strict=True)
        ]

    async def check_health(self) -> None:
        await self._lane.run(self._analyzer.check)


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, ray_actor_options={"num_cpus": 1})
class FaceDetectorModel:
    """YuNet over letterboxed images (the worker letterboxes, so only fixed-size arrays cross the handle)."""

    def __init__(self, model_config: dict[str, Any] | None = None) -> None:
        config = ModelConfig.from_dict(model_config or {})
        self._detector = config.load_detector()
        self._lane = InferenceLane()
        self._metrics = ModelMetrics("detector")
        _apply_batch_config(BatchConfig(), self.detect)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        _apply_batch_config(BatchConfig.model_validate(user_config or {}), self.detect)

    @serve.batch  # sizes: BatchConfig, applied in __init__ and reconfigure
    async def detect(self, letterboxed: list[Any]) -> list[list[DetectedFace]]:
        started = time.perf_counter()
        found = await self._lane.run(self._detector.detect_prepared, letterboxed)
        self._metrics.observe_batch(len(letterboxed), sum(map(len, found)), time.perf_counter() - started)
        return found


@dataclass(frozen=True)
class DescriptorChips:
    """The chips face model v2 needs for the faces of one image: dlib's 150 px and SFace's 112 px."""

    dlib: np.ndarray  # uint8 [F, 150, 150, 3]
    sface: np.ndarray  # uint8 [F, 112, 112, 3]


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, ray_actor_options={"num_cpus": 1})
class FaceEmbedderModel:
    """Face model v2 vectors (dlib ResNet + SFace, fused) for aligned chips, batched by faces."""

    def __init__(self, model_config: dict[str, Any] | None = None) -> None:
        config = ModelConfig.from_dict(model_config or {})
        self._embedder = config.load_embedder()
        self._lane = InferenceLane()
        self._batch = BatchConfig()
        self._metrics = ModelMetrics("embedder")
        _apply_batch_config(self._batch, self.embed)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        self._batch = BatchConfig.model_validate(user_config or {})
        _apply_batch_config(self._batch, self.embed)

    @serve.batch  # sizes: BatchConfig, applied in __init__ and reconfigure
    async def embed(self, chip_sets: list[DescriptorChips]) -> list[np.ndarray]:
        started = time.perf_counter()
        # Both chip kinds travel as one array per face (row i of each), so runs split them together.
        paired = [_pair(chips) for chips in chip_sets]
        rows = await self._lane.run(_in_runs, paired, self._batch.max_faces_per_run, self._embed_paired)
        faces = sum(len(chips.dlib) for chips in chip_sets)
        self._metrics.observe_batch(len(chip_sets), faces, time.perf_counter() - started)
        return [np.asarray(part, dtype=np.float32).reshape(-1, FUSED_DIM) for part in rows]

    def _embed_paired(self, paired: np.ndarray) -> np.ndarray:
        dlib_chips, sface_chips = _unpair(paired)
        return self._embedder.embed(dlib_chips, sface_chips)


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, ray_actor_options={"num_cpus": 1})
class AgeModel:
    """Age estimates (faceres-deep) for 224 px face views, batched by faces."""

    def __init__(self, model_config: dict[str, Any] | None = None) -> None:
        config = ModelConfig.from_dict(model_config or {})
        self._estimator = config.load_age_estimator()
        self._lane = InferenceLane()
        self._batch = BatchConfig()
        self._metrics = ModelMetrics("age")
        _apply_batch_config(self._batch, self.estimate)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        self._batch = BatchConfig.model_validate(user_config or {})
        _apply_batch_config(self._batch, self.estimate)

    @serve.batch  # sizes: BatchConfig, applied in __init__ and reconfigure
    async def estimate(self, chip_sets: list[np.ndarray]) -> list[list[Any]]:
        started = time.perf_counter()
        results = await self._lane.run(
            _in_runs, chip_sets, self._batch.max_faces_per_run, self._estimator.estimate
        )
        self._metrics.observe_batch(len(chip_sets), sum(map(len, chip_sets)), time.perf_counter() - started)
        return results

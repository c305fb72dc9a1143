"""Batch runners: what a model server runs on a batch of requests gathered from many callers.

One runner per stage of FaceAnalyzer (detector, descriptor, age) and one for the whole analysis; each loads
only the models it needs from ModelConfig. They know nothing of the server around them: serve_app wraps any
of them in the one batched model deployment (serve_app/deployments/models.py), and the worker's split
analysis (serve_app/deployments/analysis.py) calls the stage runners across handles and assembles their
answers with FaceAnalyzer.assemble, the same assembly as the in-process path.

Every runner answers one output per request, each a sequence with one entry per face (so a server can
count faces without knowing the stage), and `check()` runs every model it owns once on a tiny input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from models.age_v2 import FaceresAgeEstimator
from models.analyzer import (
    FaceAnalyzer,
    ModelConfig,
    load_face_analyzer,
    probe_age,
    probe_detector,
    probe_embedder,
)
from models.chips import CHIP_SIZE as SFACE_CHIP_SIZE
from models.detector import FaceDetector, LetterboxedImage
from models.embedder import CHIP_SIZE as DLIB_CHIP_SIZE
from models.embedder import FUSED_DIM, FusedEmbedder
from models.types import AgeEstimate, AnalyzedFace, DetectedFace

Stage = Literal["analysis", "detector", "embedder", "age"]


class BatchRunner(Protocol):
    def run(self, items: Sequence[Any], max_faces_per_run: int) -> list[Any]:
        """One output per item, in order; each output has one entry per face."""

    def check(self) -> None:
        """One tiny run through every model the runner owns; raises what a broken session raises."""


@dataclass(frozen=True)
class AnalysisRequest:
    image: np.ndarray  # uint8 RGB
    embed: bool
    estimate_age: bool


@dataclass(frozen=True)
class DescriptorChips:
    """The chips face model v2 needs for the faces of one image: dlib's 150 px and SFace's 112 px."""

    dlib: np.ndarray  # uint8 [F, 150, 150, 3]
    sface: np.ndarray  # uint8 [F, 112, 112, 3]


def in_runs(
    chip_sets: Sequence[np.ndarray], run_size: int, infer: Callable[[np.ndarray], Any]
) -> list[list[Any]]:
    """Concatenate the chips of all requests, run the model in runs of at most run_size faces, and split the
    outputs back per request: batches are sized by faces, not by requests."""
    counts = [len(chips) for chips in chip_sets]
    if sum(counts) == 0:
        return [list(infer(chip_set)) for chip_set in chip_sets]
    stacked = np.concatenate([chips for chips in chip_sets if len(chips)], axis=0)
    outputs: list[Any] = []
    for start in range(0, len(stacked), run_size):
        outputs.extend(infer(stacked[start : start + run_size]))
    results: list[list[Any]] = []
    offset = 0
    for count in counts:
        results.append(outputs[offset : offset + count])
        offset += count
    return results


_DLIB_SHAPE = (DLIB_CHIP_SIZE, DLIB_CHIP_SIZE, 3)
_DLIB_BYTES = DLIB_CHIP_SIZE * DLIB_CHIP_SIZE * 3
_SFACE_SHAPE = (SFACE_CHIP_SIZE, SFACE_CHIP_SIZE, 3)


def pair(chips: DescriptorChips) -> np.ndarray:
    """[F, 150*150*3 + 112*112*3] uint8: each face's two chips side by side, flattened, so runs of faces
    split both chip kinds together."""
    count = len(chips.dlib)
    if len(chips.sface) != count:
        raise ValueError(f"{count} dlib chips but {len(chips.sface)} SFace chips")
    return np.concatenate([chips.dlib.reshape(count, -1), chips.sface.reshape(count, -1)], axis=1)


def unpair(paired: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    count = len(paired)
    dlib = np.ascontiguousarray(paired[:, :_DLIB_BYTES]).reshape(count, *_DLIB_SHAPE)
    sface = np.ascontiguousarray(paired[:, _DLIB_BYTES:]).reshape(count, *_SFACE_SHAPE)
    return dlib, sface


def _strip(face: AnalyzedFace, request: AnalysisRequest) -> AnalyzedFace:
    """Only what the request asked for (a batch mixing requests may have computed more for its image)."""
    return AnalyzedFace(
        detection=face.detection,
        embedding=face.embedding if request.embed else None,
        age=face.age if request.estimate_age else None,
        quality=face.quality,
    )


class AnalysisRunner:
    """The whole analysis in one process: one detector run over all images, one descriptor run and one age
    run over the faces of the requests that need each."""

    def __init__(self, analyzer: FaceAnalyzer) -> None:
        self.analyzer = analyzer

    def run(self, items: Sequence[AnalysisRequest], max_faces_per_run: int) -> list[list[AnalyzedFace]]:
        needs = [(request.embed, request.estimate_age) for request in items]
        per_image = self.analyzer.analyze_each([request.image for request in items], needs)
        return [
            [_strip(face, request) for face in found] for found, request in zip(per_image, items, strict=True)
        ]

    def check(self) -> None:
        self.analyzer.check()


class DetectorRunner:
    """YuNet over letterboxed images (the caller letterboxes, so only fixed-size arrays travel)."""

    def __init__(self, detector: FaceDetector) -> None:
        self.detector = detector

    def run(self, items: Sequence[LetterboxedImage], max_faces_per_run: int) -> list[list[DetectedFace]]:
        return self.detector.detect_prepared(items)

    def check(self) -> None:
        probe_detector(self.detector)


class EmbedderRunner:
    """Face model v2 vectors (dlib ResNet + SFace, fused) for aligned chips, in runs of faces."""

    def __init__(self, embedder: FusedEmbedder) -> None:
        self.embedder = embedder

    def run(self, items: Sequence[DescriptorChips], max_faces_per_run: int) -> list[np.ndarray]:
        rows = in_runs([pair(chips) for chips in items], max_faces_per_run, self._embed_paired)
        return [np.asarray(part, dtype=np.float32).reshape(-1, FUSED_DIM) for part in rows]

    def _embed_paired(self, paired: np.ndarray) -> np.ndarray:
        return self.embedder.embed(*unpair(paired))

    def check(self) -> None:
        probe_embedder(self.embedder)


class AgeRunner:
    """Age estimates (faceres-deep) for the 224 px views of each face, in runs of faces."""

    def __init__(self, estimator: FaceresAgeEstimator) -> None:
        self.estimator = estimator

    def run(self, items: Sequence[np.ndarray], max_faces_per_run: int) -> list[list[AgeEstimate]]:
        return in_runs(items, max_faces_per_run, self.estimator.estimate)

    def check(self) -> None:
        probe_age(self.estimator)


def load_runner(stage: Stage, config: ModelConfig) -> BatchRunner:
    """The runner of one stage, with only its own models loaded (each verified by sha256)."""
    if stage == "analysis":
        return AnalysisRunner(load_face_analyzer(config))
    if stage == "detector":
        return DetectorRunner(config.load_detector())
    if stage == "embedder":
        return EmbedderRunner(config.load_embedder())
    if stage == "age":
        return AgeRunner(config.load_age_estimator())
    raise ValueError(f"unknown model stage {stage!r}")

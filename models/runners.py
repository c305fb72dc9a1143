"""Batch runners: what a model server runs on a batch of requests gathered from many callers.

One runner per stage that can run in a deployment of its own (detector, descriptor, age: models.registry
names each entry's runner) and one for the whole analysis. They know nothing of the server around them:
serve_app wraps any of them in the one batched model deployment (serve_app/deployments/models.py), and the
worker's split analysis (serve_app/deployments/analysis.py) calls the stage runners across handles and
assembles their answers with FaceAnalyzer.assemble, the same assembly as the in-process path.
models.analyzer.load_runner builds one with only its own models loaded.

Every runner answers one output per request, each a sequence with one entry per face (so a server can
count faces without knowing the stage), and `check()` runs every model it owns once on a tiny input. The
runners take any model with the methods they call (the protocols below), so a stage's new model reuses its
runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from models.chips import CHIP_SIZE as SFACE_CHIP_SIZE
from models.detector import LetterboxedImage
from models.embedder import CHIP_SIZE as DLIB_CHIP_SIZE
from models.types import AgeEstimate, AnalyzedFace, DetectedFace


class Checks(Protocol):
    def check(self) -> None:
        """One tiny run through the model; raises what a broken session raises."""


class DetectsPrepared(Checks, Protocol):
    def detect_prepared(self, batch: Sequence[LetterboxedImage]) -> list[list[DetectedFace]]: ...


class EmbedsChips(Checks, Protocol):
    """models.embedder.FaceDescriptorModel, as the embedder runner uses it."""

    @property
    def dim(self) -> int: ...

    @property
    def needs_dlib_chips(self) -> bool: ...

    def embed(self, dlib_chips: np.ndarray | None, arcface_chips: np.ndarray) -> np.ndarray: ...


class EstimatesAge(Checks, Protocol):
    def estimate(self, views: np.ndarray) -> list[AgeEstimate]: ...


class AnalyzesEach(Checks, Protocol):
    """models.analyzer.FaceAnalyzer, as the analysis runner uses it."""

    def analyze_each(
        self, images: Sequence[np.ndarray], needs: Sequence[tuple[bool, bool]]
    ) -> list[list[AnalyzedFace]]: ...


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
    """The chips the face model needs for the faces of one image: the 112 px ArcFace-aligned ones, and
    dlib's 150 px ones for face model v2 (None for a model that reads only the former)."""

    dlib: np.ndarray | None  # uint8 [F, 150, 150, 3]
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
    split both chip kinds together ([F, 112*112*3] without dlib chips)."""
    count = len(chips.sface)
    if chips.dlib is None:
        return chips.sface.reshape(count, -1)
    if len(chips.dlib) != count:
        raise ValueError(f"{len(chips.dlib)} dlib chips but {count} SFace chips")
    return np.concatenate([chips.dlib.reshape(count, -1), chips.sface.reshape(count, -1)], axis=1)


def unpair(paired: np.ndarray, with_dlib: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    count = len(paired)
    if not with_dlib:
        return None, np.ascontiguousarray(paired).reshape(count, *_SFACE_SHAPE)
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

    def __init__(self, analyzer: AnalyzesEach) -> None:
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
    """A detector over letterboxed images (the caller letterboxes, so only fixed-size arrays travel)."""

    def __init__(self, detector: DetectsPrepared) -> None:
        self.detector = detector

    def run(self, items: Sequence[LetterboxedImage], max_faces_per_run: int) -> list[list[DetectedFace]]:
        return self.detector.detect_prepared(items)

    def check(self) -> None:
        self.detector.check()


class EmbedderRunner:
    """Face vectors (face model v2: dlib ResNet + SFace, fused; or the operator's ArcFace-format model) for
    aligned chips, in runs of faces."""

    def __init__(self, embedder: EmbedsChips) -> None:
        self.embedder = embedder

    def run(self, items: Sequence[DescriptorChips], max_faces_per_run: int) -> list[np.ndarray]:
        rows = in_runs([pair(chips) for chips in items], max_faces_per_run, self._embed_paired)
        return [np.asarray(part, dtype=np.float32).reshape(-1, self.embedder.dim) for part in rows]

    def _embed_paired(self, paired: np.ndarray) -> np.ndarray:
        return self.embedder.embed(*unpair(paired, self.embedder.needs_dlib_chips))

    def check(self) -> None:
        self.embedder.check()


class AgeRunner:
    """Age estimates for the 224 px views of each face, in runs of faces."""

    def __init__(self, estimator: EstimatesAge) -> None:
        self.estimator = estimator

    def run(self, items: Sequence[np.ndarray], max_faces_per_run: int) -> list[list[AgeEstimate]]:
        return in_runs(items, max_faces_per_run, self.estimator.estimate)

    def check(self) -> None:
        self.estimator.check()

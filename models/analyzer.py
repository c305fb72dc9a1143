"""Detection, landmarks, descriptors and age for batches of images, in as few model runs as possible.

analyze() is the one-process path. A server that spreads the stages over processes calls them one by one:

    detect(images)                    one detector batch for all images
    align_and_crop(image, faces)      landmarks once per face, descriptor and age chips (CPU, dlib)
    infer(crops_of_many_images)       one descriptor run and one age run for all faces of all images
    assemble(faces, results)          AnalyzedFace lists

Every stage takes and returns plain numpy arrays and frozen dataclasses, so they pickle across processes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from models.age import (
    AGE_CHIP_MIRROR,
    AGE_CHIP_PADDINGS,
    AGE_CHIP_SIZE,
    AGE_VIEWS_PER_FACE,
    DEFAULT_MINOR_POLICY,
    AgeEstimator,
    MinorPolicy,
    age_chip_views,
)
from models.align import FaceAligner
from models.arrays import to_rgb
from models.convert import CHIP_SIZE as DESCRIPTOR_CHIP_SIZE
from models.convert import DESCRIPTOR_DIM, ensure_descriptor_model
from models.detector import DetectorOptions, FaceDetector
from models.embedder import FaceEmbedder
from models.sessions import DEFAULT_PROVIDER_PREFERENCE, SessionOptions
from models.types import AgeEstimate, AnalyzedFace, DetectedFace
from models.weights import resolve

logger = logging.getLogger(__name__)

# dlib's recipe for its ResNet descriptor (dnn_face_recognition_ex.cpp): 150 px chip, 25 % padding.
DESCRIPTOR_CHIP_PADDING = 0.25


@dataclass(frozen=True)
class ModelConfig:
    """Everything load_face_analyzer needs; the defaults are the measured operating points."""

    models_dir: Path | None = None  # cache of converted models; None: models.convert.default_models_dir()
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    provider_preference: tuple[str, ...] = DEFAULT_PROVIDER_PREFERENCE
    detector: DetectorOptions = field(default_factory=DetectorOptions)
    minor_policy: MinorPolicy = DEFAULT_MINOR_POLICY

    def session_options(self) -> SessionOptions:
        return SessionOptions(
            intra_op_threads=self.intra_op_threads,
            inter_op_threads=self.inter_op_threads,
            provider_preference=self.provider_preference,
        )


@dataclass(frozen=True)
class FaceCrops:
    """Aligned chips for the faces of one image, in detection order; None where the stage was not asked."""

    descriptor_chips: np.ndarray | None  # uint8 [F, 150, 150, 3] RGB
    age_chips: np.ndarray | None  # uint8 [F, V, 64, 64, 3] RGB, V = AGE_VIEWS_PER_FACE

    @property
    def n_faces(self) -> int:
        for chips in (self.descriptor_chips, self.age_chips):
            if chips is not None:
                return int(chips.shape[0])
        return 0


@dataclass(frozen=True)
class FaceResults:
    """Model outputs for the faces of one image, in detection order."""

    embeddings: np.ndarray | None  # float32 [F, 128]
    ages: list[AgeEstimate] | None


def largest_face(faces: Sequence[AnalyzedFace]) -> AnalyzedFace | None:
    """The face with the largest box (the first of equals), or None; the service's probe face."""
    return max(faces, key=lambda face: face.detection.area, default=None)


_Item = TypeVar("_Item", np.ndarray, list[AgeEstimate])


def _chunks(items: _Item, counts: Sequence[int]) -> list[_Item]:
    """Consecutive slices of items, of the given lengths."""
    bounds = [0, *itertools.accumulate(counts)]
    if bounds[-1] != len(items):
        raise ValueError(f"{len(items)} results for {bounds[-1]} faces")
    return [items[start:end] for start, end in itertools.pairwise(bounds)]


class FaceAnalyzer:
    def __init__(
        self,
        detector: FaceDetector,
        aligner: FaceAligner,
        embedder: FaceEmbedder,
        age_estimator: AgeEstimator,
    ) -> None:
        self.detector = detector
        self.aligner = aligner
        self.embedder = embedder
        self.age_estimator = age_estimator

    def detect(self, images: Sequence[np.ndarray]) -> list[list[DetectedFace]]:
        """Faces of every image (RGB, grayscale or RGBA uint8) from one detector batch."""
        return self.detector.detect([to_rgb(image) for image in images])

    def align_and_crop(
        self,
        image: np.ndarray,
        faces: Sequence[DetectedFace],
        embed: bool = True,
        estimate_age: bool = True,
    ) -> FaceCrops:
        """Landmarks once per face, then the descriptor chips and the age views cut from the same shapes."""
        rgb = to_rgb(image)
        if not faces or not (embed or estimate_age):
            return FaceCrops(
                descriptor_chips=np.zeros((0, DESCRIPTOR_CHIP_SIZE, DESCRIPTOR_CHIP_SIZE, 3), np.uint8)
                if embed
                else None,
                age_chips=np.zeros((0, AGE_VIEWS_PER_FACE, AGE_CHIP_SIZE, AGE_CHIP_SIZE, 3), np.uint8)
                if estimate_age
                else None,
            )
        shapes = self.aligner.shapes(rgb, list(faces))
        descriptor_chips = (
            self.aligner.chips(rgb, shapes, DESCRIPTOR_CHIP_SIZE, DESCRIPTOR_CHIP_PADDING) if embed else None
        )
        age_chips = None
        if estimate_age:
            per_padding = [self.aligner.chips(rgb, shapes, AGE_CHIP_SIZE, pad) for pad in AGE_CHIP_PADDINGS]
            age_chips = age_chip_views(per_padding, mirror=AGE_CHIP_MIRROR)
        return FaceCrops(descriptor_chips=descriptor_chips, age_chips=age_chips)

    def infer(self, crops: Sequence[FaceCrops]) -> list[FaceResults]:
        """Descriptors and ages for the crops of many images: one embed run and one age run in all."""
        descriptor_sets = [c.descriptor_chips for c in crops if c.descriptor_chips is not None]
        age_sets = [c.age_chips for c in crops if c.age_chips is not None]
        embeddings: list[np.ndarray] = []
        if descriptor_sets:
            descriptors = self.embedder.embed(np.concatenate(descriptor_sets))
            embeddings = _chunks(descriptors, [len(chips) for chips in descriptor_sets])
        ages: list[list[AgeEstimate]] = []
        if age_sets:
            estimates = self.age_estimator.estimate(np.concatenate(age_sets))
            ages = _chunks(estimates, [len(chips) for chips in age_sets])
        # Hand the chunks back to the images that asked for them, in order.
        embedding_chunks, age_chunks = iter(embeddings), iter(ages)
        return [
            FaceResults(
                embeddings=next(embedding_chunks) if c.descriptor_chips is not None else None,
                ages=next(age_chunks) if c.age_chips is not None else None,
            )
            for c in crops
        ]

    @staticmethod
    def assemble(faces: Sequence[DetectedFace], results: FaceResults) -> list[AnalyzedFace]:
        for name, values in (("embeddings", results.embeddings), ("ages", results.ages)):
            if values is not None and len(values) != len(faces):
                raise ValueError(f"{len(faces)} faces but {len(values)} {name}")
        return [
            AnalyzedFace(
                detection=face,
                embedding=results.embeddings[i] if results.embeddings is not None else None,
                age=results.ages[i] if results.ages is not None else None,
            )
            for i, face in enumerate(faces)
        ]

    def analyze(
        self, images: Sequence[np.ndarray], embed: bool = True, estimate_age: bool = True
    ) -> list[list[AnalyzedFace]]:
        """Faces of every image with descriptors and/or age estimates, in detection order (best first)."""
        rgb = [to_rgb(image) for image in images]
        detections = self.detector.detect(rgb)
        crops = [
            self.align_and_crop(image, faces, embed=embed, estimate_age=estimate_age)
            for image, faces in zip(rgb, detections, strict=True)
        ]
        results = self.infer(crops)
        return [self.assemble(faces, result) for faces, result in zip(detections, results, strict=True)]


def load_face_analyzer(config: ModelConfig) -> FaceAnalyzer:
    """Verify every weight file by sha256, convert the descriptor to ONNX if not cached, build and warm up
    the sessions. Raises WeightFileError / ModelFormatError naming the file and the fix."""
    options = config.session_options()
    detector_path = resolve("yunet_2023mar_int8bq")
    shape_path = resolve("dlib_shape5")
    age_path = resolve("age_v1")
    descriptor_path = ensure_descriptor_model(config.models_dir)
    analyzer = FaceAnalyzer(
        detector=FaceDetector(detector_path, config.detector, options),
        aligner=FaceAligner(shape_path),
        embedder=FaceEmbedder(descriptor_path, options),
        age_estimator=AgeEstimator(age_path, options, config.minor_policy),
    )
    logger.info(
        "face analyzer ready: descriptor %s (%d-d), age views %d, %d intra-op threads",
        descriptor_path.name,
        DESCRIPTOR_DIM,
        AGE_VIEWS_PER_FACE,
        config.intra_op_threads,
    )
    return analyzer

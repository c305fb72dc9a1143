"""Detection, landmarks, descriptors and age for batches of images, in as few model runs as possible.

FaceAnalyzer.analyze() is the one-process path. A server that spreads the stages over processes uses them
one by one (each loads only what it needs from ModelConfig):

    detect(images)                one detector batch for all images     ModelConfig.load_detector()
    FaceCropper(image, faces)     landmarks once per face, descriptor   ModelConfig.load_cropper()
                                  chips (CPU, dlib); age views of the
                                  subject (and of comparable faces,
                                  models.age_policy) from the boxes
    infer(crops of many images)   one descriptor run, one age run       load_embedder(), load_age_estimator()
    assemble(faces, results,      AnalyzedFace lists (quality is measured by the cropper for every face)
             qualities)

Which model serves each stage, and from which files, is models.registry's; load_runner builds the batch
runner of one stage (or of the whole analysis) for a model server.

Every stage takes and returns numpy arrays and frozen dataclasses, so they pickle across processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from models.age_policy import age_faces as policy_age_faces
from models.age_v2 import VIEWS_PER_FACE as AGE_VIEWS_PER_FACE
from models.age_v2 import face_views
from models.arrays import to_rgb
from models.chips import aligned_chips
from models.detector import DetectorOptions, LetterboxedImage, letterbox
from models.embedder import CHIP_SIZE as DESCRIPTOR_CHIP_SIZE
from models.face_model import OperatorFaceModel
from models.quality import DEFAULT_QUALITY_THRESHOLDS, QualityThresholds, assess_quality
from models.registry import MODELS, AgeEstimator, Aligner, Detector, Embedder, ModelEntry, Models, Stage
from models.runners import AnalysisRunner, BatchRunner
from models.sessions import DEFAULT_PROVIDER_PREFERENCE, SessionOptions
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality
from models.types import largest_face as largest_face  # re-exported: callers import it from here

logger = logging.getLogger(__name__)

_M = TypeVar("_M")

# dlib's recipe for its ResNet descriptor (dnn_face_recognition_ex.cpp): 150 px chip, 25 % padding.
DESCRIPTOR_CHIP_PADDING = 0.25


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to run it; the defaults are the measured operating points."""

    models_dir: Path | None = None  # the converted models; None: models.weights.default_models_dir()
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    allow_spinning: bool = False  # see SessionOptions: off is faster wherever cores are shared
    # None: CUDA when this machine has it, else CPU. A list that puts an accelerator first is a requirement:
    # start-up fails without it unless allow_cpu_fallback is true.
    provider_preference: tuple[str, ...] | None = None
    allow_cpu_fallback: bool = False
    cuda_conv_algo_search: Literal["exhaustive", "heuristic", "default"] = "exhaustive"  # see SessionOptions
    # Rows per run on a GPU (SessionOptions.gpu_run_size): images for the detector, faces for the others.
    # Sized to the service's usual batches: measured on an H200 (bench/gpu.py), a run of 16 faces costs the
    # age model 14 ms against 71 ms for 64, and padding 8 images to 64 made detection 5x dearer per image.
    gpu_image_run_size: int = 8
    gpu_face_run_size: int = 16
    detector: DetectorOptions = field(default_factory=DetectorOptions)
    # A recognition model the operator brings in place of face model v2. Not a config file key: it comes
    # from the settings (FACESEARCH_FACE_MODEL_*), which every process reads, because the ingress and the
    # stores must agree on the gallery version it makes (serve_app.wiring.models).
    face_model: OperatorFaceModel | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """From a config file's `model_config` mapping; a nested `detector` mapping holds the fields of
        DetectorOptions. Unknown keys are an error, not silently ignored (the under_18 / under_21 flags are
        models.age_policy's calibrated intervals, set by FACESEARCH_AGE_MINOR_CLEARED_RATE)."""
        known = {item.name for item in dataclasses.fields(cls)} - {"face_model"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model_config keys {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = dict(data)
        if values.get("models_dir") is not None:
            values["models_dir"] = Path(values["models_dir"])
        if "provider_preference" in values:
            values["provider_preference"] = tuple(values["provider_preference"])
        if isinstance(values.get("detector"), Mapping):
            values["detector"] = DetectorOptions(**values["detector"])
        return cls(**values)

    def session_options(self, gpu_run_size: int = 0) -> SessionOptions:
        return SessionOptions(
            intra_op_threads=self.intra_op_threads,
            inter_op_threads=self.inter_op_threads,
            provider_preference=self.provider_preference or DEFAULT_PROVIDER_PREFERENCE,
            allow_spinning=self.allow_spinning,
            if_preferred_missing=self._if_preferred_missing(),
            cuda_conv_algo_search=self.cuda_conv_algo_search,
            gpu_run_size=gpu_run_size,
        )

    def requires_accelerator(self) -> bool:
        """Whether the sessions refuse to start without the accelerator the preference puts first."""
        return self._if_preferred_missing() == "fail"

    def _if_preferred_missing(self) -> Literal["fallback", "warn", "fail"]:
        if not self.provider_preference or self.provider_preference[0] == "CPUExecutionProvider":
            return "fallback"
        return "warn" if self.allow_cpu_fallback else "fail"

    @property
    def models(self) -> Models:
        """The registry's models with the configured face model."""
        return MODELS.with_face_model(self.face_model)

    def verify_files(self) -> None:
        """Every file the registry's models load, verified by sha256 without building a session:
        WeightFileError naming the file and the fix. For a launcher, before it starts the processes that
        load them."""
        for entry in self.models.entries().values():
            if entry.workloads:
                entry.files(self.models_dir)

    def load(self, entry: ModelEntry[_M]) -> _M:
        """A registry entry's model: its files verified by sha256 (WeightFileError names the file and the
        fix; the converted ones are built beforehand by `facesearch models fetch`, never here), its sessions
        sized to the rows of its GPU runs."""
        run_sizes = {"images": self.gpu_image_run_size, "faces": self.gpu_face_run_size}
        run_size = run_sizes[entry.gpu_rows] if entry.gpu_rows else 0
        return entry.load(entry.files(self.models_dir), self.session_options(run_size), self)

    def load_detector(self) -> Detector:
        return self.load(self.models.detector)

    def load_cropper(self) -> FaceCropper:
        """The cropper; with dlib's landmarks only when the face model reads dlib's chips."""
        landmarks = self.models.landmarks
        return FaceCropper(self.load(landmarks) if landmarks.workloads else None)

    def load_embedder(self) -> Embedder:
        return self.load(self.models.embedder)

    def load_age_estimator(self) -> AgeEstimator:
        return self.load(self.models.age)

    def letterboxer(self) -> Callable[[np.ndarray], LetterboxedImage]:
        """The detector's image preparation, for a process that sends letterboxed images to a detector
        elsewhere; it needs only the options, no model."""
        options = self.detector
        return lambda image: letterbox(image, options)


@dataclass(frozen=True)
class FaceCrops:
    """Aligned chips for the faces of one image, in detection order; None where the stage was not asked."""

    # uint8 [F, 150, 150, 3] RGB (dlib), when descriptors were asked for and the face model reads them
    descriptor_chips: np.ndarray | None
    # Age runs on the subject (the largest face) and on the other faces the age rules need
    # (models.age_policy.age_faces): uint8 [K, V, 224, 224, 3] RGB views of the faces listed in age_faces,
    # subject first, V = AGE_VIEWS_PER_FACE.
    age_views: np.ndarray | None
    qualities: tuple[FaceQuality, ...] = ()  # one per face, always measured (models.quality)
    age_faces: tuple[int, ...] = ()  # indices (detection order) of the faces in age_views
    # uint8 [F, 112, 112, 3] RGB, ArcFace-aligned (SFace's, or the operator's ArcFace-format model's);
    # present exactly when descriptors were asked for
    sface_chips: np.ndarray | None = None

    @property
    def n_faces(self) -> int:
        if self.sface_chips is not None:
            return int(self.sface_chips.shape[0])
        return len(self.qualities)


@dataclass(frozen=True)
class FaceResults:
    """Model outputs for the faces of one image, in detection order; None where not asked."""

    embeddings: np.ndarray | None  # float32 [F, D] (the face model's vector size)
    ages: list[AgeEstimate] | None  # one per index in age_faces
    age_faces: tuple[int, ...] = ()


class FaceCropper:
    """Landmarks once per face for the descriptor chips; age views from the detector boxes of the subject
    and of the other faces the age rules need. Without an aligner (a face model that reads only the
    ArcFace chips) no dlib landmarks or chips are made."""

    def __init__(
        self, aligner: Aligner | None, quality_thresholds: QualityThresholds = DEFAULT_QUALITY_THRESHOLDS
    ) -> None:
        self.aligner = aligner
        self.quality_thresholds = quality_thresholds

    def __call__(
        self,
        image: np.ndarray,
        faces: Sequence[DetectedFace],
        embed: bool = True,
        estimate_age: bool = True,
    ) -> FaceCrops:
        rgb = to_rgb(image)
        # The 112 px ArcFace chips serve SFace and the quality gate's sharpness, so they are always cut.
        sface_chips = aligned_chips(rgb, [face.landmarks for face in faces])
        qualities = tuple(
            assess_quality(face, chip, self.quality_thresholds, rgb)
            for face, chip in zip(faces, sface_chips, strict=True)
        )
        # Age crops come from the detector box, so dlib's landmarks are needed only for the descriptor.
        descriptor_chips = None
        if embed and self.aligner is not None:
            shapes = self.aligner.shapes(rgb, list(faces)) if faces else []
            descriptor_chips = self._chips(rgb, shapes, DESCRIPTOR_CHIP_SIZE, DESCRIPTOR_CHIP_PADDING)
        age_views = None
        age_faces: tuple[int, ...] = ()
        if estimate_age:
            # The subject and the other faces the age rules look at (models.age_policy.age_faces).
            age_faces = policy_age_faces(faces)
            age_views = face_views(rgb, [faces[i].box for i in age_faces])
        return FaceCrops(
            descriptor_chips=descriptor_chips,
            age_views=age_views,
            qualities=qualities,
            age_faces=age_faces,
            sface_chips=sface_chips if embed else None,
        )

    def _chips(self, rgb: np.ndarray, shapes: Sequence[Any], size: int, padding: float) -> np.ndarray:
        if not shapes or self.aligner is None:
            return np.zeros((0, size, size, 3), dtype=np.uint8)
        return self.aligner.chips(rgb, list(shapes), size, padding)


_Rows = TypeVar("_Rows", np.ndarray, list[AgeEstimate])


def _chunks(rows: _Rows, counts: Sequence[int]) -> list[_Rows]:
    """Consecutive slices of rows with the given lengths."""
    bounds = [0, *itertools.accumulate(counts)]
    if bounds[-1] != len(rows):
        raise ValueError(f"model returned {len(rows)} rows for {bounds[-1]} faces")
    return [rows[start:end] for start, end in itertools.pairwise(bounds)]


class FaceAnalyzer:
    def __init__(
        self,
        detector: Detector,
        cropper: FaceCropper,
        embedder: Embedder,
        age_estimator: AgeEstimator,
    ) -> None:
        self.detector = detector
        self.cropper = cropper
        self.embedder = embedder
        self.age_estimator = age_estimator

    def detect(self, images: Sequence[np.ndarray]) -> list[list[DetectedFace]]:
        """Faces of every image (RGB, grayscale or RGBA uint8), best first, from one detector batch."""
        return self.detector.detect([to_rgb(image) for image in images])

    def align_and_crop(
        self, image: np.ndarray, faces: Sequence[DetectedFace], embed: bool = True, estimate_age: bool = True
    ) -> FaceCrops:
        return self.cropper(image, faces, embed=embed, estimate_age=estimate_age)

    def infer(self, crops: Sequence[FaceCrops]) -> list[FaceResults]:
        """Descriptors and ages for the crops of many images: one embed run and one age run in all."""
        sface_sets = [c.sface_chips for c in crops if c.sface_chips is not None]
        descriptor_sets = [c.descriptor_chips for c in crops if c.sface_chips is not None]
        age_sets = [c.age_views for c in crops if c.age_views is not None]
        embeddings: list[np.ndarray] = []
        if sface_sets:
            dlib_chips = None
            if self.embedder.needs_dlib_chips:
                if any(chips is None for chips in descriptor_sets):
                    raise ValueError("the face model needs dlib chips, and the cropper made none")
                dlib_chips = np.concatenate([c for c in descriptor_sets if c is not None])
            descriptors = self.embedder.embed(dlib_chips, np.concatenate(sface_sets))
            embeddings = _chunks(descriptors, [len(chips) for chips in sface_sets])
        ages: list[list[AgeEstimate]] = []
        if age_sets:
            estimates = self.age_estimator.estimate(np.concatenate(age_sets))
            ages = _chunks(estimates, [len(chips) for chips in age_sets])
        # Hand the chunks back, in order, to the images that asked for them.
        embedding_chunks, age_chunks = iter(embeddings), iter(ages)
        return [
            FaceResults(
                embeddings=next(embedding_chunks) if c.sface_chips is not None else None,
                ages=next(age_chunks) if c.age_views is not None else None,
                age_faces=c.age_faces,
            )
            for c in crops
        ]

    @staticmethod
    def assemble(
        faces: Sequence[DetectedFace], results: FaceResults, qualities: Sequence[FaceQuality] = ()
    ) -> list[AnalyzedFace]:
        if qualities and len(qualities) != len(faces):
            raise ValueError(f"{len(faces)} faces but {len(qualities)} quality measurements")
        if results.embeddings is not None and len(results.embeddings) != len(faces):
            raise ValueError(f"{len(faces)} faces but {len(results.embeddings)} embeddings")
        ages: dict[int, AgeEstimate] = {}
        if results.ages is not None:
            if len(results.ages) != len(results.age_faces) or not all(
                0 <= i < len(faces) for i in results.age_faces
            ):
                raise ValueError(f"{len(results.ages)} ages for faces {results.age_faces} of {len(faces)}")
            ages = dict(zip(results.age_faces, results.ages, strict=True))
        return [
            AnalyzedFace(
                detection=face,
                embedding=results.embeddings[i] if results.embeddings is not None else None,
                age=ages.get(i),
                quality=qualities[i] if qualities else None,
            )
            for i, face in enumerate(faces)
        ]

    def analyze(
        self, images: Sequence[np.ndarray], embed: bool = True, estimate_age: bool = True
    ) -> list[list[AnalyzedFace]]:
        """Faces of every image with descriptors and/or age estimates, in detection order (best first)."""
        return self.analyze_each(images, [(embed, estimate_age)] * len(images))

    def analyze_each(
        self, images: Sequence[np.ndarray], needs: Sequence[tuple[bool, bool]]
    ) -> list[list[AnalyzedFace]]:
        """Like analyze(), with (embed, estimate_age) per image: one detector batch, then each model runs
        only on the faces of the images that asked for it (a face search in the same batch as an age
        estimate does not make the age model run on the search's faces, nor the embedders on the age's)."""
        if len(needs) != len(images):
            raise ValueError(f"{len(images)} images but {len(needs)} requests")
        rgb = [to_rgb(image) for image in images]
        detections = self.detector.detect(rgb)
        crops = [
            self.cropper(image, faces, embed=embed, estimate_age=estimate_age)
            for image, faces, (embed, estimate_age) in zip(rgb, detections, needs, strict=True)
        ]
        results = self.infer(crops)
        return [
            self.assemble(faces, result, crop.qualities)
            for faces, result, crop in zip(detections, results, crops, strict=True)
        ]

    def check(self) -> None:
        """Health check: one tiny run through every model; raises whatever a broken session raises."""
        self.detector.check()
        self.embedder.check()
        self.age_estimator.check()


def load_face_analyzer(config: ModelConfig) -> FaceAnalyzer:
    """Verify every weight file by sha256, convert the descriptor to ONNX if it is not cached, and build the
    sessions (each warmed up). Raises WeightFileError / ModelFormatError naming the file and the fix."""
    analyzer = FaceAnalyzer(
        detector=config.load_detector(),
        cropper=config.load_cropper(),
        embedder=config.load_embedder(),
        age_estimator=config.load_age_estimator(),
    )
    logger.info(
        "face analyzer ready: %d age views per face, %d intra-op threads",
        AGE_VIEWS_PER_FACE,
        config.intra_op_threads,
    )
    return analyzer


def load_runner(stage: Literal["analysis"] | Stage, config: ModelConfig) -> BatchRunner:
    """The batch runner of the whole analysis or of one stage (its registry entry's runner), with only its
    own models loaded (each verified by sha256)."""
    if stage == "analysis":
        return AnalysisRunner(load_face_analyzer(config))
    entry = config.models.entry(stage)
    if entry.runner is None:
        raise ValueError(f"the {stage} model runs inside the worker, not behind a runner of its own")
    runner: BatchRunner = entry.runner(config.load(entry))
    return runner

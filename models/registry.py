"""The models the service serves: one entry per stage of the analysis, and everything that serves a model
reads it.

An entry names the model, its weight files (models.weights), how to build it from them, which asks of a
request run it, what one of its GPU runs counts, and, for a model that gets a deployment of its own in the
split topology, that deployment's name, the runner that batches it there (models.runners) and its share of
a GPU. Who reads it: models.analyzer.ModelConfig loads each stage's model through its entry (the files
verified by sha256, the sessions sized by its GPU rows) and verifies every entry's files before a launch;
models.analyzer.load_runner builds a stage's runner from it; serve_app.deployments.user_config names one
model deployment per entry that has one (the names the config files use), and serve_app.launch.topology
binds exactly those in the split topology, each with its share of a GPU when the config requires CUDA.
Nothing here knows of Ray or HTTP.

The stages are fixed by the analysis (FaceAnalyzer: detect, landmarks, descriptors, age); the model serving a
stage is not. Each stage's class is named once below (Detector, Aligner, Embedder, AgeEstimator) and the
analyzer is typed by those names, so a class that lacks a method the analysis calls fails mypy. Replacing a
stage's model is its module, its weight spec in models.weights and its entry here (docs/development.md,
"Adding a model").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeAlias, TypeVar, cast

from models import weights
from models.age_v2 import AgeCalibration, FaceresAgeEstimator
from models.align import FaceAligner
from models.arcface import ArcFaceEmbedder
from models.calibration import FaceScoreCalibration
from models.detector import DetectorOptions, FaceDetector
from models.embedder import FaceDescriptorModel, FaceEmbedder, FusedEmbedder, SFaceEmbedder
from models.face_model import OperatorFaceModel
from models.runners import AgeRunner, BatchRunner, DetectorRunner, EmbedderRunner
from models.sessions import SessionOptions

Stage = Literal["detector", "landmarks", "embedder", "age"]
# What a request may ask of the analysis: every request detects; "embed" asks for descriptors (search,
# enrolment), "age" for an age estimate.
Workload = Literal["detect", "embed", "age"]
# What one GPU run of a model counts, so which of ModelConfig's run sizes applies: gpu_image_run_size or
# gpu_face_run_size (cuDNN sets up again at every new input shape, so every run has exactly that many rows).
Rows = Literal["images", "faces"]

# The class serving each stage. models.analyzer (FaceAnalyzer, ModelConfig's loaders) is typed by these names.
Detector: TypeAlias = FaceDetector
Aligner: TypeAlias = FaceAligner
# The face model is the shipped face model v2 or a recognition model the operator brings (with_face_model).
Embedder: TypeAlias = FaceDescriptorModel
AgeEstimator: TypeAlias = FaceresAgeEstimator


class LoadSettings(Protocol):
    """What a loader may read of the model settings (models.analyzer.ModelConfig)."""

    @property
    def detector(self) -> DetectorOptions: ...


M = TypeVar("M")


@dataclass(frozen=True)
class ModelEntry(Generic[M]):
    """One served model."""

    name: str  # as logs and docs name it
    # Names in models.weights, in the order `load` takes them: the converted file where CONVERTED has one
    # (built by `facesearch models fetch`), else the file as its package ships it (WEIGHTS); or a file the
    # operator brings, with the sha256 the configuration records for it.
    weights: tuple[str | weights.OperatorWeight, ...]
    # Builds the model from its verified files and the session options sized for it.
    load: Callable[[Sequence[Path], SessionOptions, LoadSettings], M]
    workloads: frozenset[Workload]  # the asks that run it
    gpu_rows: Rows | None  # None: it never runs on ONNX Runtime (dlib on the CPU)
    # The split topology's deployment for it (None: it runs inside the transaction worker), the runner
    # that deployment batches it with (models.runners), and the share of a GPU its replicas take when the
    # config requires CUDA (a config's own ray_actor_options for the deployment replace it).
    deployment: str | None = None
    runner: Callable[[M], BatchRunner] | None = None
    gpu_share: float = 0.0

    def files(self, models_dir: Path | None = None) -> list[Path]:
        """Its weight files, each verified by sha256 (WeightFileError names the file and the fix)."""
        return [_verified(name, models_dir) for name in self.weights]


def _verified(name: str | weights.OperatorWeight, models_dir: Path | None) -> Path:
    if isinstance(name, weights.OperatorWeight):
        return weights.verify_operator(name)
    return weights.converted(name, models_dir) if name in weights.CONVERTED else weights.resolve(name)


@dataclass(frozen=True)
class Models:
    """The model serving each stage (the field names are the stages)."""

    detector: ModelEntry[Detector]
    landmarks: ModelEntry[Aligner]
    embedder: ModelEntry[Embedder]
    age: ModelEntry[AgeEstimator]

    def entries(self) -> dict[Stage, ModelEntry[Any]]:
        return {cast(Stage, item.name): getattr(self, item.name) for item in fields(self)}

    def entry(self, stage: str) -> ModelEntry[Any]:
        entries = self.entries()
        if stage not in entries:
            raise ValueError(f"unknown model stage {stage!r}; known: {sorted(entries)}")
        return entries[stage]

    def deployments(self) -> dict[str, Stage]:
        """The model deployments of the split topology, by name, and the stage each serves."""
        return {entry.deployment: stage for stage, entry in self.entries().items() if entry.deployment}

    def with_face_model(self, model: OperatorFaceModel | None) -> Models:
        """These models with the operator's recognition model as the face model (None: these unchanged). It
        serves the embedder stage under the same deployment, on the ArcFace chips every face gets, so
        dlib's landmarks are then asked by nothing (no workload runs them)."""
        if model is None:
            return self
        return dataclasses.replace(
            self,
            landmarks=dataclasses.replace(self.landmarks, workloads=frozenset()),
            embedder=operator_embedder(model, self.embedder),
        )


def operator_embedder(model: OperatorFaceModel, shipped: ModelEntry[Embedder]) -> ModelEntry[Embedder]:
    """The registry entry of an operator's ArcFace-format model, in the shipped face model's place."""
    weight = weights.OperatorWeight(
        model.path, model.sha256, "FACESEARCH_FACE_MODEL_PATH / FACESEARCH_FACE_MODEL_SHA256"
    )
    return dataclasses.replace(
        shipped,
        name=f"operator ArcFace model {model.path.name} ({model.version})",
        weights=(weight,),
        load=lambda files, session, settings: ArcFaceEmbedder(files[0], session, model),
    )


MODELS = Models(
    detector=ModelEntry(
        name="YuNet 2023mar",
        weights=("yunet_2023mar_int8bq",),
        load=lambda files, session, settings: FaceDetector(files[0], settings.detector, session),
        workloads=frozenset({"detect", "embed", "age"}),
        gpu_rows="images",
        deployment="FaceDetectorModel",
        runner=DetectorRunner,
        gpu_share=0.25,
    ),
    landmarks=ModelEntry(
        name="dlib 5-point landmarks",
        weights=("dlib_shape5",),
        load=lambda files, session, settings: FaceAligner(files[0]),
        workloads=frozenset({"embed"}),
        gpu_rows=None,
    ),
    embedder=ModelEntry(
        name="face model v2 (dlib ResNet + SFace, fused)",
        weights=("dlib_resnet_v1", "sface_2021dec_int8bq"),
        load=lambda files, session, settings: FusedEmbedder(
            FaceEmbedder(files[0], session), SFaceEmbedder(files[1], session), FaceScoreCalibration.load()
        ),
        workloads=frozenset({"embed"}),
        gpu_rows="faces",
        deployment="FaceEmbedderModel",
        runner=EmbedderRunner,
        gpu_share=0.25,
    ),
    age=ModelEntry(
        name="age-v2 (faceres-deep)",
        weights=("faceres_deep",),
        load=lambda files, session, settings: FaceresAgeEstimator(files[0], session, AgeCalibration.load()),
        workloads=frozenset({"age"}),
        gpu_rows="faces",
        deployment="AgeModel",
        runner=AgeRunner,
        gpu_share=0.25,
    ),
)

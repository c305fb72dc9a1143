"""dlib ResNet face descriptors on ONNX Runtime, batched.

Feed chips made by dlib.get_face_chip(img, shape5, size=150, padding=0.25) (uint8 RGB); the model does
dlib's normalisation itself. Descriptors are NOT L2-normalised: compare them by Euclidean distance, as dlib
does (its operating threshold is 0.6).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import numpy as np

from models.calibration import FaceScoreCalibration
from models.chips import CHIP_SIZE as SFACE_CHIP_SIZE
from models.errors import ModelFormatError
from models.sessions import SessionOptions, SessionRunner, create_session, fixed_run_size, run_padded

# The served face model's version and vector size live in models.types (no model library behind them), so
# the ingress can name the gallery's collection without loading the models; re-exported here.
from models.types import FUSED_DIM as FUSED_DIM
from models.types import MODEL_VERSION as MODEL_VERSION

# The converted models' interfaces: model_build writes its graphs with exactly these names and sizes.
CHIP_SIZE = 150  # dlib's ResNet descriptor chip
DESCRIPTOR_DIM = 128
INPUT_NAME = "chips"
OUTPUT_NAME = "descriptors"
SFACE_DIM = 128
SFACE_INPUT = "chips"
SFACE_OUTPUT = "embeddings"

CHIP_SHAPE = (CHIP_SIZE, CHIP_SIZE, 3)
SFACE_CHIP_SHAPE = (SFACE_CHIP_SIZE, SFACE_CHIP_SIZE, 3)
_WARMUP_BATCH = 2


class FaceEmbedder(SessionRunner):
    """128-d dlib face descriptors for batches of aligned 150x150 RGB chips."""

    def __init__(self, model_path: Path, options: SessionOptions) -> None:
        warmup = {INPUT_NAME: np.zeros((_WARMUP_BATCH, *CHIP_SHAPE), dtype=np.uint8)}
        self._session = create_session(model_path, options, warmup_feed=warmup)
        self._run_size = fixed_run_size(self._session, options)
        inputs = [node.name for node in self._session.get_inputs()]
        outputs = [node.name for node in self._session.get_outputs()]
        if inputs != [INPUT_NAME] or outputs != [OUTPUT_NAME]:
            raise ModelFormatError(
                f"{model_path}: expected input {INPUT_NAME!r} and output {OUTPUT_NAME!r}, found "
                f"{inputs} -> {outputs}; regenerate it with `facesearch models fetch`"
            )
        self.model_path = model_path

    def embed(self, chips: np.ndarray) -> np.ndarray:
        """[N,150,150,3] uint8 RGB chips -> float32 [N,128] descriptors (N may be 0)."""
        if chips.dtype != np.uint8 or chips.ndim != 4 or chips.shape[1:] != CHIP_SHAPE:
            raise ValueError(
                f"chips must be uint8 [N,{CHIP_SIZE},{CHIP_SIZE},3] RGB, got {chips.dtype} {chips.shape}"
            )
        if chips.shape[0] == 0:
            # ONNX Runtime handles empty batches inconsistently across kernels; answer it here.
            return np.zeros((0, DESCRIPTOR_DIM), dtype=np.float32)
        (descriptors,) = run_padded(
            self._session, [OUTPUT_NAME], INPUT_NAME, np.ascontiguousarray(chips), self._run_size
        )
        return np.asarray(descriptors, dtype=np.float32)


class SFaceEmbedder(SessionRunner):
    """128-d SFace embeddings, L2-normalised, for batches of 112 px ArcFace-aligned RGB chips
    (models.chips); compare by inner product (cosine)."""

    def __init__(self, model_path: Path, options: SessionOptions) -> None:
        warmup = {SFACE_INPUT: np.zeros((_WARMUP_BATCH, *SFACE_CHIP_SHAPE), dtype=np.uint8)}
        self._session = create_session(model_path, options, warmup_feed=warmup)
        self._run_size = fixed_run_size(self._session, options)
        inputs = [node.name for node in self._session.get_inputs()]
        outputs = [node.name for node in self._session.get_outputs()]
        if inputs != [SFACE_INPUT] or outputs != [SFACE_OUTPUT]:
            raise ModelFormatError(
                f"{model_path}: expected input {SFACE_INPUT!r} and output {SFACE_OUTPUT!r}, found "
                f"{inputs} -> {outputs}; regenerate it with `facesearch models fetch`"
            )
        self.model_path = model_path

    def embed(self, chips: np.ndarray) -> np.ndarray:
        """[N,112,112,3] uint8 RGB chips -> float32 [N,128] unit vectors (N may be 0)."""
        if chips.dtype != np.uint8 or chips.ndim != 4 or chips.shape[1:] != SFACE_CHIP_SHAPE:
            raise ValueError(
                f"chips must be uint8 [N,{SFACE_CHIP_SIZE},{SFACE_CHIP_SIZE},3] RGB, "
                f"got {chips.dtype} {chips.shape}"
            )
        if chips.shape[0] == 0:
            return np.zeros((0, SFACE_DIM), dtype=np.float32)
        (raw,) = run_padded(
            self._session, [SFACE_OUTPUT], SFACE_INPUT, np.ascontiguousarray(chips), self._run_size
        )
        return unit_rows(np.asarray(raw, dtype=np.float32))


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to length 1 (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit: np.ndarray = (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
    return unit


def fuse_vectors(dlib_unit: np.ndarray, sface_unit: np.ndarray, weights: tuple[float, float]) -> np.ndarray:
    """One unit vector per face whose inner product with another is the weighted mean of the two models'
    cosines: [w_d * dlib, w_s * sface] / sqrt(w_d^2 + w_s^2). With w_i = 1 / sqrt(sigma_i) (sigma_i the
    spread of the model's cosines over all pairs) the fused cosine is, up to constants, the sum of the two
    z-normalised similarities, so one Milvus inner-product search ranks by the fused score."""
    w_dlib, w_sface = weights
    norm = math.hypot(w_dlib, w_sface)
    return np.concatenate([dlib_unit * (w_dlib / norm), sface_unit * (w_sface / norm)], axis=1).astype(
        np.float32
    )


class FaceDescriptorModel(Protocol):
    """The face model the service serves (models.registry's embedder stage): face model v2 (FusedEmbedder)
    or a recognition model the operator brings (models.arcface.ArcFaceEmbedder). Its vectors are unit
    vectors compared by inner product, stored under its version."""

    @property
    def version(self) -> str: ...

    @property
    def dim(self) -> int: ...

    @property
    def needs_dlib_chips(self) -> bool:
        """Whether embed() reads dlib's 150 px chips (the analysis cuts them only then)."""

    def embed(self, dlib_chips: np.ndarray | None, arcface_chips: np.ndarray) -> np.ndarray:
        """Unit vectors [N, dim] for the faces of [N,150,150,3] dlib chips (None when not needed) and
        [N,112,112,3] ArcFace-aligned chips, all uint8 RGB."""

    def check(self) -> None:
        """One face through the model (a health check); raises what a broken session raises."""


class FusedEmbedder:
    """Face model v2: the dlib descriptor and SFace embedding of each face, fused into one 256-d unit
    vector (fuse_vectors) with the weights stored in the score calibration."""

    version = MODEL_VERSION
    dim = FUSED_DIM
    needs_dlib_chips = True

    def __init__(self, dlib: FaceEmbedder, sface: SFaceEmbedder, calibration: FaceScoreCalibration) -> None:
        if calibration.model_version != MODEL_VERSION:
            raise ModelFormatError(
                f"score calibration is for {calibration.model_version!r}, the embedder is {MODEL_VERSION!r}"
            )
        if calibration.fusion_weights is None:
            raise ModelFormatError(f"the score calibration of {MODEL_VERSION!r} has no fusion weights")
        self.dlib = dlib
        self.sface = sface
        self.weights = calibration.fusion_weights

    def embed(self, dlib_chips: np.ndarray | None, sface_chips: np.ndarray) -> np.ndarray:
        """[N,150,150,3] dlib chips and [N,112,112,3] ArcFace chips of the same faces -> float32 [N,256]."""
        if dlib_chips is None:
            raise ValueError("face model v2 needs the dlib chips of the faces")
        if len(dlib_chips) != len(sface_chips):
            raise ValueError(f"{len(dlib_chips)} dlib chips but {len(sface_chips)} SFace chips")
        return fuse_vectors(
            unit_rows(self.dlib.embed(dlib_chips)), self.sface.embed(sface_chips), self.weights
        )

    def check(self) -> None:
        """One face through both descriptors (a health check); raises what a broken session raises."""
        self.embed(
            np.zeros((1, *CHIP_SHAPE), dtype=np.uint8), np.zeros((1, *SFACE_CHIP_SHAPE), dtype=np.uint8)
        )

"""Which face model the service serves, said without loading any model library: the ingress, the stores and
the command-line tools need its version (the gallery's collection is named after it) and its vector size.

Two kinds of face model:
- the shipped one, face model v2 (dlib ResNet + SFace, fused; models.embedder), version MODEL_VERSION;
- a recognition model the operator brings (OperatorFaceModel): an ArcFace-format ONNX file, declared by its
  path and sha256 (FACESEARCH_FACE_MODEL_PATH / _SHA256), run by models.arcface on the same 112 px chips,
  aligned from the detector's five landmarks onto the ArcFace template, that SFace uses (models.chips).

A model's vectors are never compared with another's: each version has its own collection, and
`facesearch reindex` moves a tenant's gallery onto the serving version (docs/models.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from models.types import FUSED_DIM, MODEL_VERSION

_SHA256 = re.compile(r"[0-9a-f]{64}")
# The version of an operator's model is named by the start of its file's sha256: another file is another
# version (its vectors live in a collection of their own), a renamed or moved file is the same one.
OPERATOR_VERSION_PREFIX = "arcface_"
OPERATOR_VERSION_DIGITS = 16


@dataclass(frozen=True)
class ServedFaceModel:
    """What the stores need to know of the serving face model."""

    version: str  # stored with every vector and record; names the gallery's collection
    dim: int  # vector size


SHIPPED_FACE_MODEL = ServedFaceModel(version=MODEL_VERSION, dim=FUSED_DIM)


@dataclass(frozen=True)
class OperatorFaceModel:
    """An ArcFace-format recognition model the operator brings: one ONNX input of 112x112 RGB faces aligned
    to the ArcFace 5-point template, NCHW float32 normalised as (x - 127.5) / 127.5; one output, the
    embedding (compared by cosine after L2 normalisation)."""

    path: Path
    sha256: str
    dim: int = 512  # its embedding size; checked against the model's output when it loads
    # Its score table (models.calibration: cosine -> per-comparison false-match rate), written by
    # `facesearch calibrate --write-scores FILE` on the operator's labelled photos. The service needs it to
    # report scores; the calibration can run without it.
    scores: Path | None = None

    def __post_init__(self) -> None:
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"the face model's sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if self.dim < 1:
            raise ValueError(f"the face model's embedding size must be positive, got {self.dim}")

    @property
    def version(self) -> str:
        return f"{OPERATOR_VERSION_PREFIX}{self.sha256[:OPERATOR_VERSION_DIGITS]}"

    @property
    def served(self) -> ServedFaceModel:
        return ServedFaceModel(version=self.version, dim=self.dim)


def served_face_model(operator: OperatorFaceModel | None) -> ServedFaceModel:
    """The operator's model when one is declared, else the shipped face model v2."""
    return operator.served if operator is not None else SHIPPED_FACE_MODEL

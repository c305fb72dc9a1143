"""A recognition model the operator brings, in the ArcFace format (models.face_model.OperatorFaceModel), on
ONNX Runtime through the same session factory as every other model (CPU or CUDA, models.sessions).

The format is InsightFace's (its packs' `w600k_r50.onnx`, `glintr100.onnx`) and many others': one input,
NCHW float32 [N, 3, 112, 112] of RGB faces aligned by a similarity transform from five landmarks onto the
ArcFace template (models.chips, the chips SFace takes too) and normalised as (x - 127.5) / 127.5; one
output, the embedding [N, D], compared by cosine. A graph whose batch dimension is fixed at 1 runs one face
at a time.

inspect() reads a file or a folder of ONNX files (an unpacked InsightFace pack) and says which one is a
recognition model of this format, by its input and output shapes (the rule InsightFace's own model router
uses: a square input of 112 px), with its sha256 and embedding size: what FACESEARCH_FACE_MODEL_PATH,
_SHA256 and _DIM take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from models.chips import CHIP_SIZE
from models.embedder import unit_rows
from models.errors import ModelError, ModelFormatError
from models.face_model import OperatorFaceModel
from models.sessions import SessionOptions, SessionRunner, create_session, fixed_run_size, run_padded, warm_up
from models.weights import sha256_of

ARCFACE_MEAN = 127.5
ARCFACE_STD = 127.5
_CHIP_SHAPE = (CHIP_SIZE, CHIP_SIZE, 3)


@dataclass(frozen=True)
class GraphInterface:
    """What the graph declares: its input's name and shape, its output's name and size (None: symbolic)."""

    input_name: str
    input_shape: tuple[int | str | None, ...]
    output_name: str
    output_dim: int | None
    fixed_batch_of_one: bool


def graph_interface(session: ort.InferenceSession, source: str) -> GraphInterface:
    """The ArcFace format's interface, or ModelFormatError saying what the graph has instead."""
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1 or len(outputs) < 1:
        raise ModelFormatError(
            f"{source}: an ArcFace-format model has one input and an embedding output; this one has inputs "
            f"{[i.name for i in inputs]} and outputs {[o.name for o in outputs]}"
        )
    shape = tuple(inputs[0].shape)
    if len(shape) != 4 or shape[1:] != (3, CHIP_SIZE, CHIP_SIZE):
        raise ModelFormatError(
            f"{source}: an ArcFace-format model takes NCHW [N, 3, {CHIP_SIZE}, {CHIP_SIZE}] faces; this one "
            f"takes {list(shape)} ({inputs[0].name!r})"
        )
    if inputs[0].type != "tensor(float)":
        raise ModelFormatError(f"{source}: the input must be float32, it is {inputs[0].type}")
    out_shape = tuple(outputs[0].shape)
    if len(out_shape) != 2:
        raise ModelFormatError(
            f"{source}: the first output must be an embedding [N, D]; it is {list(out_shape)} "
            f"({outputs[0].name!r})"
        )
    dim = out_shape[1] if isinstance(out_shape[1], int) else None
    return GraphInterface(
        input_name=inputs[0].name,
        input_shape=shape,
        output_name=outputs[0].name,
        output_dim=dim,
        fixed_batch_of_one=shape[0] == 1,
    )


def arcface_input(chips: np.ndarray) -> np.ndarray:
    """uint8 RGB chips [N, 112, 112, 3] -> the format's float32 NCHW input, (x - 127.5) / 127.5."""
    scaled = (chips.astype(np.float32) - ARCFACE_MEAN) / ARCFACE_STD
    return np.ascontiguousarray(scaled.transpose(0, 3, 1, 2))


class ArcFaceEmbedder(SessionRunner):
    """The operator's recognition model as the service's face model: unit vectors of `spec.dim` for the
    112 px ArcFace chips; it needs no dlib chips."""

    needs_dlib_chips = False

    def __init__(self, model_path: Path, options: SessionOptions, spec: OperatorFaceModel) -> None:
        try:
            self._session = create_session(model_path, options)
        except ModelError:
            raise  # CUDA asked for and missing: said as such
        # ONNX Runtime's load errors (not an ONNX file, an operator it lacks) share no base below Exception.
        except Exception as error:
            raise ModelFormatError(f"{model_path}: ONNX Runtime cannot load it: {error}") from error
        self._interface = graph_interface(self._session, str(model_path))
        self._run_size = 1 if self._interface.fixed_batch_of_one else fixed_run_size(self._session, options)
        self.version = spec.version
        self.dim = spec.dim
        self.model_path = model_path
        probe = self._run(np.zeros((1, *_CHIP_SHAPE), dtype=np.uint8))
        if probe.shape[1] != spec.dim:
            raise ModelFormatError(
                f"{model_path}: its embeddings have {probe.shape[1]} values, the configuration says "
                f"{spec.dim}: set FACESEARCH_FACE_MODEL_DIM={probe.shape[1]} (a new size is a new gallery "
                "version anyway)"
            )
        if not self._interface.fixed_batch_of_one:
            warm_up(self._session, options, {self._interface.input_name: arcface_input(_zeros(2))})

    def _run(self, chips: np.ndarray) -> np.ndarray:
        (raw,) = run_padded(
            self._session, [self._interface.output_name], self._interface.input_name, arcface_input(chips),
            self._run_size,
        )  # fmt: skip
        return np.asarray(raw, dtype=np.float32).reshape(len(chips), -1)

    def embed(self, dlib_chips: np.ndarray | None, arcface_chips: np.ndarray) -> np.ndarray:
        """[N,112,112,3] uint8 RGB ArcFace chips -> float32 [N, dim] unit vectors (N may be 0); dlib's chips
        are not used."""
        chips = arcface_chips
        if chips.dtype != np.uint8 or chips.ndim != 4 or chips.shape[1:] != _CHIP_SHAPE:
            raise ValueError(
                f"chips must be uint8 [N,{CHIP_SIZE},{CHIP_SIZE},3] RGB, got {chips.dtype} {chips.shape}"
            )
        if len(chips) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return unit_rows(self._run(chips))

    def check(self) -> None:
        self.embed(None, _zeros(1))


def _zeros(count: int) -> np.ndarray:
    return np.zeros((count, *_CHIP_SHAPE), dtype=np.uint8)


@dataclass(frozen=True)
class InspectedModel:
    """One ONNX file of a folder, as `facesearch models inspect` reports it."""

    path: Path
    sha256: str
    recognition: bool  # an ArcFace-format recognition model the service can serve
    dim: int | None  # its embedding size (None when not a recognition model)
    note: str  # why it is not one, or what to check


def inspect(path: Path) -> list[InspectedModel]:
    """Every .onnx file of a folder (or the one file given), each judged against the ArcFace format."""
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder")
    files: Sequence[Path] = sorted(path.glob("*.onnx")) if path.is_dir() else [path]
    if not files:
        raise ModelFormatError(f"{path}: no .onnx file there (unpack a zipped model pack first)")
    return [_inspect_one(file) for file in files]


def _inspect_one(path: Path) -> InspectedModel:
    digest = sha256_of(path)
    try:
        session = create_session(path, SessionOptions(provider_preference=("CPUExecutionProvider",)))
        interface = graph_interface(session, path.name)
        raw = session.run([interface.output_name], {interface.input_name: arcface_input(_zeros(1))})[0]
    # ONNX Runtime's load errors share no base class below Exception; the report names the error.
    except Exception as error:
        return InspectedModel(path, digest, False, None, str(error).strip().splitlines()[0][:300])
    dim = int(np.asarray(raw).reshape(1, -1).shape[1])
    notes = []
    if interface.fixed_batch_of_one:
        notes.append("batch fixed at 1: it runs one face at a time")
    if normalises_itself(onnx.load(str(path), load_external_data=False)):
        notes.append(
            "its graph starts by scaling its input itself (an MXNet conversion that takes raw 0-255 "
            "pixels): the service feeds (x - 127.5) / 127.5, so such a model scores badly"
        )
    return InspectedModel(path, digest, True, dim, "; ".join(notes))


def normalises_itself(model: onnx.ModelProto) -> bool:
    """InsightFace's own test for its MXNet-converted ArcFace graphs, which take raw 0-255 pixels: a Sub and
    a Mul among the first nodes (it reads their names; the operator types say the same)."""
    first = model.graph.node[:8]
    sub = any(node.op_type == "Sub" or node.name.startswith(("Sub", "_minus")) for node in first)
    mul = any(node.op_type == "Mul" or node.name.startswith(("Mul", "_mul")) for node in first)
    return sub and mul

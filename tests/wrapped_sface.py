"""A real recognition model in the ArcFace format, for the tests and the benchmark of operator face models:
the service's own SFace (its converted graph, which takes uint8 RGB chips [N, 112, 112, 3]) behind a small
ONNX graph built here that takes the ArcFace convention, float32 NCHW [N, 3, 112, 112] holding
(x - 127.5) / 127.5, and gives SFace back its pixels: x * 127.5 + 127.5, rounded, as uint8 NHWC.

Served through FACESEARCH_FACE_MODEL_PATH it must give exactly SFace's embeddings on the same chips, so its
accuracy is SFace's: the check that the operator-model path (alignment, normalisation, batching, unit
vectors) adds nothing and loses nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, compose, helper, numpy_helper

from models.chips import CHIP_SIZE
from models.weights import converted

ARCFACE_INPUT = "input.1"  # as InsightFace's recognition models name theirs
SFACE_INPUT = "chips"


def _constant(name: str, value: float, dtype: type[np.generic] = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def arcface_adapter(opset: int, ir_version: int) -> onnx.ModelProto:
    """float32 NCHW (x - 127.5) / 127.5 -> uint8 NHWC pixels."""
    nodes = [
        helper.make_node("Mul", [ARCFACE_INPUT, "half_range"], ["scaled"]),
        helper.make_node("Add", ["scaled", "half_range"], ["shifted"]),
        helper.make_node("Round", ["shifted"], ["rounded"]),
        helper.make_node("Clip", ["rounded", "zero", "full_range"], ["clipped"]),
        helper.make_node("Cast", ["clipped"], ["pixels_nchw"], to=TensorProto.UINT8),
        helper.make_node("Transpose", ["pixels_nchw"], ["pixels"], perm=[0, 2, 3, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "arcface_to_sface_pixels",
        [helper.make_tensor_value_info(ARCFACE_INPUT, TensorProto.FLOAT, ["N", 3, CHIP_SIZE, CHIP_SIZE])],
        [helper.make_tensor_value_info("pixels", TensorProto.UINT8, ["N", CHIP_SIZE, CHIP_SIZE, 3])],
        initializer=[_constant("half_range", 127.5), _constant("zero", 0.0), _constant("full_range", 255.0)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def wrapped_sface(sface: onnx.ModelProto) -> onnx.ModelProto:
    opset = next(entry.version for entry in sface.opset_import if entry.domain in ("", "ai.onnx"))
    adapter = arcface_adapter(opset, sface.ir_version)
    merged = compose.merge_models(adapter, sface, io_map=[("pixels", SFACE_INPUT)], prefix2="sface/")
    onnx.checker.check_model(merged)
    return merged


def write_wrapped_sface(directory: Path, models_dir: Path | None = None) -> tuple[Path, str]:
    """The wrapped model written into directory; (its path, its sha256)."""
    sface = onnx.load(str(converted("sface_2021dec_int8bq", models_dir)))
    path = directory / "sface_arcface_wrapped.onnx"
    onnx.save(wrapped_sface(sface), str(path))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()

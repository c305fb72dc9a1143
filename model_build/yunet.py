"""YuNet (OpenCV Zoo, face_detection_yunet_2023mar int8bq) converted into a plain float32 graph.

The shipped file keeps its weights as int8 blocks behind 64 DequantizeLinear nodes, each followed by a
Reshape to the convolution's weight shape. models.detector.make_runnable folds the DequantizeLinear nodes
and makes batch, height and width symbolic, but it left the 56 weight Reshapes as nodes: ONNX Runtime has
to fold them itself at every session start, and the file it serves differs from what any tool can inspect.
The conversion does all of it once, at build time, as for SFace:
- make_runnable (weights dequantised, batch / height / width symbolic);
- each Reshape of a constant folded into the initializer it makes, so every Conv reads its weights
  directly (53 Conv, 15 Relu and the head's ops remain);
- a Cast in front, so the graph takes what models.detector.letterbox makes: uint8 BGR [N, 3, S, S]. The
  conversion to float then runs inside ONNX Runtime (on a GPU: after a copy of a quarter of the bytes).

The weights are the same numbers (no requantisation), so the faces and boxes are those of the shipped file
(tests/unit/models/test_yunet_converted.py). model_build.fetch writes the result into the models directory.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.detector import INPUT_NAME, make_runnable
from models.errors import ModelFormatError

IR_VERSION = 10  # opset 21, as the source
_FLOAT_INPUT = "input_f32"


def build_yunet_model(source: onnx.ModelProto) -> onnx.ModelProto:
    """The float32 graph with symbolic batch / height / width and uint8 input, from the shipped file."""
    model = make_runnable(source)
    graph = model.graph
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}
    kept = []
    folded = 0
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type == "Reshape" and all(name in constants for name in inputs):
            shape = constants[inputs[1]].astype(np.int64)
            constants[node.output[0]] = np.ascontiguousarray(constants[inputs[0]].reshape(shape))
            folded += 1
        else:
            kept.append(node)
    if folded == 0:
        raise ModelFormatError("no weight Reshapes found: not the int8bq YuNet file")
    for node in kept:  # the image now enters through the Cast
        for index, name in enumerate(node.input):
            if name == INPUT_NAME:
                node.input[index] = _FLOAT_INPUT
    del graph.node[:]
    graph.node.extend(
        [
            helper.make_node("Cast", [INPUT_NAME], [_FLOAT_INPUT], to=TensorProto.FLOAT, name="input_cast"),
            *kept,
        ]
    )
    used = {name for node in graph.node for name in node.input}
    del graph.initializer[:]
    graph.initializer.extend(
        numpy_helper.from_array(np.asarray(constants[name]), name) for name in sorted(used & set(constants))
    )
    graph.input[0].type.tensor_type.elem_type = TensorProto.UINT8
    model.ir_version = IR_VERSION
    model.producer_name = "facesearch.models.yunet"  # kept: it is part of the recorded sha256
    onnx.checker.check_model(model)
    return model

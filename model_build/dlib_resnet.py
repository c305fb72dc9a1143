"""Convert dlib's ResNet face descriptor (dlib_face_recognition_resnet_model_v1.dat) to ONNX.

The .dat file stores weights and layer records but not the topology (tag/skip/add_prev ids are absent), so
the network definition from dlib's dnn_face_recognition_ex.cpp is encoded here and every layer read from
the file is checked against it (type, filter count, kernel, stride) as it is consumed:

    fc_no_bias<128, avg_pool_everything<
      alevel0 = ares_down<256>                  alevel1 = ares<256>, ares<256>, ares_down<256>
      alevel2 = ares<128> x2, ares_down<128>    alevel3 = ares<64> x3, ares_down<64>
      alevel4 = ares<32> x3
      max_pool<3,3,2,2, relu<affine<con<32,7,7,2,2, input_rgb_image_sized<150>>>>>>>
    block<N, stride>  = affine<con<N,3,3,1,1, relu<affine<con<N,3,3,stride,stride, x>>>>>
    ares<N>(x)        = relu(add_prev(block<N,1>(x), x))
    ares_down<N>(x)   = relu(add_prev(avg_pool<2,2,2,2>(x), block<N,2>(x)))

The converted graph takes uint8 RGB chips [N,150,150,3] (dynamic N) and does dlib's input normalisation
itself, so callers feed exactly what dlib.get_face_chip returns (the interface models.embedder expects).
model_build.fetch writes the result into the models directory at install/build time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model_build.dlib_dat import (
    AddPrevLayer,
    AffineLayer,
    ConvLayer,
    DnnFile,
    FcLayer,
    Layer,
    PassThrough,
    PoolLayer,
    ReluLayer,
)
from models.embedder import CHIP_SIZE, DESCRIPTOR_DIM, INPUT_NAME, OUTPUT_NAME
from models.errors import ModelFormatError

OPSET = 17
# IR version 8 is what opset 17 shipped with; pinning it keeps the file loadable by older runtimes too.
IR_VERSION = 8

_LayerT = TypeVar("_LayerT", ConvLayer, AffineLayer, ReluLayer, PoolLayer, AddPrevLayer, FcLayer, PassThrough)


@dataclass(frozen=True)
class _Value:
    """A graph value with its static NCHW shape (N is dynamic)."""

    name: str
    channels: int
    rows: int
    cols: int


def _pooled(size: int, window: int, stride: int, padding: int) -> int:
    # dlib and ONNX (floor mode) agree: 1 + (in + 2*pad - window) / stride, rounded down.
    return 1 + (size + 2 * padding - window) // stride


class _GraphBuilder:
    """Consumes the file's layers in order (innermost first) while emitting ONNX nodes."""

    def __init__(self, net: DnnFile) -> None:
        self._net = net
        self._position = 0
        self._names = 0
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _fresh(self, stem: str) -> str:
        self._names += 1
        return f"{stem}_{self._names}"

    def _constant(self, stem: str, array: np.ndarray) -> str:
        name = self._fresh(stem)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def _node(
        self, op: str, inputs: Sequence[str], stem: str, output: str | None = None, **attrs: Any
    ) -> str:
        out = output or self._fresh(stem)
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=self._fresh(op), **attrs))
        return out

    def _take(self, kind: type[_LayerT], what: str) -> _LayerT:
        layers = self._net.layers
        if self._position >= len(layers):
            raise ModelFormatError(
                f"{self._net.source}: the network ends where {what} was expected: "
                "not dlib_face_recognition_resnet_model_v1"
            )
        layer: Layer = layers[self._position]
        if not isinstance(layer, kind):
            raise ModelFormatError(
                f"{self._net.source}: layer {self._position} at offset {layer.offset} is "
                f"{type(layer).__name__}, expected {kind.__name__} ({what}): "
                "not dlib_face_recognition_resnet_model_v1"
            )
        self._position += 1
        return layer

    def _mismatch(self, layer: Layer, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self._net.source}: layer at offset {layer.offset}: {message}")

    def finish(self) -> None:
        if self._position != len(self._net.layers):
            extra = self._net.layers[self._position]
            raise self._mismatch(extra, "unexpected extra layers after the final fc layer")

    # ---- layers ----

    def input(self) -> _Value:
        record = self._net.input
        if (record.rows, record.cols) != (CHIP_SIZE, CHIP_SIZE):
            raise ModelFormatError(
                f"{self._net.source}: input is {record.rows}x{record.cols}, expected {CHIP_SIZE}x{CHIP_SIZE}"
            )
        # dlib's input_rgb_image_sized: (pixel - avg) / 256 per channel, R,G,B order, planar output.
        as_float = self._node("Cast", [INPUT_NAME], "chips_f32", to=TensorProto.FLOAT)
        mean = self._constant("rgb_mean", np.asarray(record.avg_rgb, dtype=np.float32))
        centred = self._node("Sub", [as_float, mean], "centred")
        scale = self._constant("input_scale", np.asarray(1.0 / 256.0, dtype=np.float32))
        scaled = self._node("Mul", [centred, scale], "scaled")
        planar = self._node("Transpose", [scaled], "nchw", perm=[0, 3, 1, 2])
        return _Value(planar, 3, record.rows, record.cols)

    def conv_affine(self, x: _Value, filters: int, kernel: int, stride: int) -> _Value:
        """A con layer followed by its affine layer, folded into one Conv: gamma*(W*x+b)+beta."""
        what = f"con<{filters},{kernel},{kernel},{stride},{stride}>"
        conv = self._take(ConvLayer, what)
        if (
            conv.num_filters != filters
            or conv.kernel != (kernel, kernel)
            or conv.stride != (stride, stride)
            or conv.filters.shape[1] != x.channels
        ):
            raise self._mismatch(
                conv,
                f"expected {what} over {x.channels} channels, found {conv.filters.shape} "
                f"stride {conv.stride}",
            )
        affine = self._take(AffineLayer, f"affine after {what}")
        if not affine.conv_mode or affine.gamma.size != filters:
            raise self._mismatch(affine, f"expected a conv-mode affine over {filters} channels")
        # Fold in float64 so the only float32 rounding is the final cast.
        gamma = affine.gamma.reshape(-1).astype(np.float64)
        beta = affine.beta.reshape(-1).astype(np.float64)
        bias = conv.biases.astype(np.float64) if conv.biases is not None else np.zeros(filters)
        w = (conv.filters.astype(np.float64) * gamma[:, None, None, None]).astype(np.float32)
        b = (bias * gamma + beta).astype(np.float32)
        pad_y, pad_x = conv.padding
        out = self._node(
            "Conv",
            [x.name, self._constant("conv_w", w), self._constant("conv_b", b)],
            "conv",
            kernel_shape=[kernel, kernel],
            strides=list(conv.stride),
            pads=[pad_y, pad_x, pad_y, pad_x],
        )
        return _Value(
            out,
            filters,
            _pooled(x.rows, kernel, stride, pad_y),
            _pooled(x.cols, kernel, stride, pad_x),
        )

    def relu(self, x: _Value) -> _Value:
        self._take(ReluLayer, "relu")
        return _Value(self._node("Relu", [x.name], "relu"), x.channels, x.rows, x.cols)

    def pool(self, x: _Value, kind: str, window: int, stride: int) -> _Value:
        what = f"{kind}_pool<{window},{window},{stride},{stride}>"
        layer = self._take(PoolLayer, what)
        if layer.kind != kind or layer.window != (window, window) or layer.stride != (stride, stride):
            raise self._mismatch(layer, f"expected {what}, found {layer}")
        if layer.padding != (0, 0):
            # Every pool in this network is unpadded; padded pooling semantics are not needed here.
            raise self._mismatch(layer, f"padded pooling {layer.padding} is not supported")
        op = "MaxPool" if kind == "max" else "AveragePool"
        out = self._node(op, [x.name], f"{kind}pool", kernel_shape=[window, window], strides=[stride, stride])
        return _Value(out, x.channels, _pooled(x.rows, window, stride, 0), _pooled(x.cols, window, stride, 0))

    def global_average(self, x: _Value) -> _Value:
        layer = self._take(PoolLayer, "avg_pool_everything")
        if layer.kind != "avg" or layer.window != (0, 0):
            raise self._mismatch(layer, f"expected avg_pool_everything, found {layer}")
        return _Value(self._node("GlobalAveragePool", [x.name], "gap"), x.channels, 1, 1)

    def passthrough(self, what: str) -> None:
        self._take(PassThrough, what)

    def _extend(self, x: _Value, channels: int, rows: int, cols: int) -> str:
        if (x.channels, x.rows, x.cols) == (channels, rows, cols):
            return x.name
        # Zero-extend at the end of each axis: dlib's add_prev aligns mismatched tensors top-left.
        pads = np.asarray(
            [0, 0, 0, 0, 0, channels - x.channels, rows - x.rows, cols - x.cols], dtype=np.int64
        )
        return self._node("Pad", [x.name, self._constant("pads", pads)], "extended")

    def add_prev(self, a: _Value, b: _Value) -> _Value:
        self._take(AddPrevLayer, "add_prev")
        channels, rows, cols = max(a.channels, b.channels), max(a.rows, b.rows), max(a.cols, b.cols)
        left, right = self._extend(a, channels, rows, cols), self._extend(b, channels, rows, cols)
        return _Value(self._node("Add", [left, right], "sum"), channels, rows, cols)

    def fc_no_bias(self, x: _Value, outputs: int) -> str:
        layer = self._take(FcLayer, f"fc_no_bias<{outputs}>")
        inputs = x.channels * x.rows * x.cols
        if layer.biases is not None or layer.weights.shape != (inputs, outputs):
            raise self._mismatch(
                layer, f"expected fc_no_bias {inputs}x{outputs}, found {layer.weights.shape}"
            )
        flat = self._node("Flatten", [x.name], "flat", axis=1)
        weights_name = self._constant("fc_w", np.ascontiguousarray(layer.weights, dtype=np.float32))
        return self._node("MatMul", [flat, weights_name], "fc", output=OUTPUT_NAME)


def _residual(builder: _GraphBuilder, x: _Value, filters: int) -> _Value:
    """ares<N>: relu(add_prev1(block<N,1>(tag1(x)), tag1))."""
    builder.passthrough("tag1")
    y = builder.relu(builder.conv_affine(x, filters, 3, 1))
    y = builder.conv_affine(y, filters, 3, 1)
    return builder.relu(builder.add_prev(y, x))


def _residual_down(builder: _GraphBuilder, x: _Value, filters: int) -> _Value:
    """ares_down<N>: relu(add_prev2(avg_pool<2,2,2,2>(skip1), tag2(block<N,2>(tag1(x)))))."""
    builder.passthrough("tag1")
    y = builder.relu(builder.conv_affine(x, filters, 3, 2))
    y = builder.conv_affine(y, filters, 3, 1)
    builder.passthrough("tag2")
    builder.passthrough("skip1")
    skip = builder.pool(x, "avg", 2, 2)
    return builder.relu(builder.add_prev(skip, y))


# (filters, number of ares blocks, whether the level starts with ares_down), innermost level first.
_LEVELS: tuple[tuple[int, int, bool], ...] = (
    (32, 3, False),  # alevel4
    (64, 3, True),  # alevel3
    (128, 2, True),  # alevel2
    (256, 2, True),  # alevel1
    (256, 0, True),  # alevel0
)


def build_descriptor_model(net: DnnFile) -> onnx.ModelProto:
    """ONNX model of dlib_face_recognition_resnet_model_v1 from its parsed .dat file."""
    builder = _GraphBuilder(net)
    x = builder.input()
    x = builder.pool(builder.relu(builder.conv_affine(x, 32, 7, 2)), "max", 3, 2)
    for filters, repeats, down in _LEVELS:
        if down:
            x = _residual_down(builder, x, filters)
        for _ in range(repeats):
            x = _residual(builder, x, filters)
    builder.fc_no_bias(builder.global_average(x), DESCRIPTOR_DIM)
    builder.finish()

    graph = helper.make_graph(
        builder.nodes,
        "dlib_face_recognition_resnet_model_v1",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["N", CHIP_SIZE, CHIP_SIZE, 3])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", DESCRIPTOR_DIM])],
        initializer=builder.initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="facesearch.models.convert",  # kept: it is part of the recorded sha256
        doc_string=f"converted from {Path(net.source).name}",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model

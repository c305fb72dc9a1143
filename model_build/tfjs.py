"""Read a TensorFlow.js graph model (model.json + .bin weight shards) and write it as ONNX, no TensorFlow.

The format: model.json holds `modelTopology.node` (a TensorFlow GraphDef as JSON: name, op, input, attr) and
`weightsManifest` (groups of shard paths and the weights they hold, in order: name, shape, dtype). The shards
of a group are one byte stream, cut into the weights in manifest order. Attributes use TF's JSON encoding:
strings are base64, ints are decimal strings.

The converter handles the ops of NHWC convolutional classifiers such as HSE's faceres-deep: Const,
Placeholder, Identity, Conv2D, DepthwiseConv2dNative, _FusedConv2D / FusedDepthwiseConv2dNative and
_FusedMatMul (fused BiasAdd, Relu, Relu6), BiasAdd, Add/AddV2, Sub, Mul, Relu, Relu6, Minimum, Maximum,
Mean, Sigmoid, Softmax. Any other op, an unsupported attribute value, or a shard of the wrong length is a
ModelFormatError naming it. The ONNX graph keeps the model's NHWC input (dynamic batch) and transposes once
to NCHW; 4-d constants are transposed and 1-d per-channel constants reshaped to broadcast over NCHW.
TF 'SAME' padding (extra pixel at the end) is ONNX auto_pad SAME_UPPER.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.errors import ModelFormatError

OPSET = 17
IR_VERSION = 8  # what opset 17 shipped with, as for the dlib conversion

_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
}
_TF_DTYPES = {"DT_FLOAT": "float32", "DT_INT32": "int32"}


@dataclass(frozen=True)
class TfjsNode:
    name: str
    op: str
    inputs: tuple[str, ...]
    attr: dict[str, Any]

    def string(self, key: str, default: str | None = None) -> str:
        value = self.attr.get(key, {}).get("s")
        if value is None:
            if default is None:
                raise ModelFormatError(f"node {self.name} ({self.op}) has no string attribute {key!r}")
            return default
        return base64.b64decode(value).decode("ascii")

    def ints(self, key: str) -> list[int]:
        return [int(v) for v in self.attr.get(key, {}).get("list", {}).get("i", [])]

    def strings(self, key: str) -> list[str]:
        values = self.attr.get(key, {}).get("list", {}).get("s", [])
        return [base64.b64decode(v).decode("ascii") for v in values]

    def flag(self, key: str) -> bool:
        return bool(self.attr.get(key, {}).get("b", False))


@dataclass(frozen=True)
class TfjsGraph:
    source: str
    nodes: tuple[TfjsNode, ...]
    weights: dict[str, np.ndarray] = field(repr=False)
    outputs: tuple[str, ...]  # signature output tensor names without ":0"

    def node(self, name: str) -> TfjsNode:
        for item in self.nodes:
            if item.name == name:
                return item
        raise ModelFormatError(f"{self.source}: no node named {name!r}")


def _tensor_name(reference: str) -> str:
    """'node:0' and 'node' name the same tensor; control inputs ('^node') are not data."""
    name = reference.split(":", 1)[0]
    if reference.split(":", 1)[1:] not in ([], ["0"]):
        raise ModelFormatError(f"multi-output tensor {reference!r} is not supported")
    return name


def read_graph_model(model_json: Path) -> TfjsGraph:
    """Parse model.json and its weight shards (found next to it). Raises ModelFormatError on any mismatch."""
    try:
        document = json.loads(model_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFormatError(f"cannot read the TFJS model {model_json}: {error}") from error
    if not isinstance(document, dict) or document.get("format") != "graph-model":
        raise ModelFormatError(f"{model_json} is not a TFJS graph model (format != 'graph-model')")
    try:
        raw_nodes = document["modelTopology"]["node"]
        manifest = document["weightsManifest"]
    except (KeyError, TypeError) as error:
        raise ModelFormatError(f"{model_json}: missing {error} in the TFJS graph model") from error
    nodes = tuple(
        TfjsNode(
            name=str(item["name"]),
            op=str(item["op"]),
            inputs=tuple(str(i) for i in item.get("input", []) if not str(i).startswith("^")),
            attr=dict(item.get("attr", {})),
        )
        for item in raw_nodes
    )
    weights: dict[str, np.ndarray] = {}
    for group in manifest:
        blob = b""
        for shard in group["paths"]:
            path = model_json.parent / shard
            if Path(shard).name != shard:
                raise ModelFormatError(f"{model_json}: shard path {shard!r} leaves the model's folder")
            try:
                blob += path.read_bytes()
            except OSError as error:
                raise ModelFormatError(f"{model_json}: cannot read weight shard {path}: {error}") from error
        offset = 0
        for entry in group["weights"]:
            if "quantization" in entry:
                raise ModelFormatError(f"{model_json}: quantised weight {entry['name']} is not supported")
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ModelFormatError(f"{model_json}: weight {entry['name']} has dtype {entry['dtype']}")
            shape = tuple(int(d) for d in entry["shape"])
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if offset + size > len(blob):
                raise ModelFormatError(
                    f"{model_json}: the weight shards hold {len(blob)} bytes but the manifest needs at least "
                    f"{offset + size} (at {entry['name']}): the .bin file is truncated or from another model"
                )
            weights[entry["name"]] = np.frombuffer(blob, dtype, count=size // dtype.itemsize, offset=offset)
            weights[entry["name"]] = weights[entry["name"]].reshape(shape).astype(dtype.newbyteorder("="))
            offset += size
        if offset != len(blob):
            raise ModelFormatError(
                f"{model_json}: the weight shards hold {len(blob)} bytes but the manifest describes "
                f"{offset}: the .bin file does not belong to this model.json"
            )
    signature = document.get("signature", {}).get("outputs", {})
    outputs = tuple(_tensor_name(str(item.get("name", key))) for key, item in signature.items())
    return TfjsGraph(source=str(model_json), nodes=nodes, weights=weights, outputs=outputs)


class _Converter:
    """Emits ONNX nodes for the subgraph that computes the requested outputs."""

    def __init__(self, graph: TfjsGraph) -> None:
        self.graph = graph
        self.by_name = {node.name: node for node in graph.nodes}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        # TF tensor name -> (ONNX value name, rank, is_constant); 4-d activations are stored NCHW.
        self.values: dict[str, tuple[str, int]] = {}
        self.constants: dict[str, np.ndarray] = {}
        self._count = 0

    def fresh(self, stem: str) -> str:
        self._count += 1
        return f"{stem}__{self._count}"

    def add_constant(self, stem: str, array: np.ndarray) -> str:
        name = self.fresh(stem)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def emit(self, op: str, inputs: Sequence[str], stem: str, **attrs: Any) -> str:
        out = self.fresh(stem)
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=self.fresh(op), **attrs))
        return out

    def fail(self, node: TfjsNode, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.graph.source}: node {node.name} ({node.op}): {message}")

    # ---- values ----

    def constant_of(self, name: str) -> np.ndarray | None:
        node = self.by_name.get(name)
        if node is None:
            raise ModelFormatError(f"{self.graph.source}: input {name!r} is not a node of the graph")
        if node.op != "Const":
            return None
        if name not in self.graph.weights:
            raise self.fail(node, "constant without weights in the manifest")
        return self.graph.weights[name]

    def value(self, reference: str) -> tuple[str, int]:
        """ONNX name and rank of a non-constant tensor, converting its producer first."""
        name = _tensor_name(reference)
        if name not in self.values:
            self.convert(self.by_name[name] if name in self.by_name else self._missing(name))
        return self.values[name]

    def _missing(self, name: str) -> TfjsNode:
        raise ModelFormatError(f"{self.graph.source}: input {name!r} is not a node of the graph")

    def operand(self, reference: str, other_rank: int) -> str:
        """An elementwise operand: a graph value, or a constant laid out to broadcast against a value of
        rank other_rank (NCHW when 4-d)."""
        name = _tensor_name(reference)
        array = self.constant_of(name)
        if array is None:
            return self.value(reference)[0]
        array = np.asarray(array, dtype=np.float32)
        if other_rank == 4:
            if array.ndim == 1:
                array = array.reshape(-1, 1, 1)  # per-channel: C -> [C, 1, 1] against NCHW
            elif array.ndim == 4:
                array = array.transpose(0, 3, 1, 2)
            elif array.ndim not in (0,):
                raise ModelFormatError(
                    f"{self.graph.source}: constant {name} of shape {array.shape} cannot broadcast over NHWC"
                )
        return self.add_constant(name.replace("/", "_"), array)

    # ---- ops ----

    def convert(self, node: TfjsNode) -> None:
        handler = getattr(self, f"op_{node.op}", None)
        if handler is None:
            raise self.fail(node, "unsupported op for the TFJS-to-ONNX converter")
        handler(node)

    def op_Const(self, node: TfjsNode) -> None:
        raise self.fail(node, "a constant used where an activation is expected")

    def op_Placeholder(self, node: TfjsNode) -> None:
        dims = node.attr.get("shape", {}).get("shape", {}).get("dim", [])
        shape: list[int | str] = [int(d.get("size", -1)) for d in dims]
        dtype = _TF_DTYPES.get(node.attr.get("dtype", {}).get("type", ""))
        if dtype != "float32":
            raise self.fail(node, "only float32 inputs are supported")
        shape = ["N" if (i == 0 or s == -1) else s for i, s in enumerate(shape)]
        self.inputs.append(helper.make_tensor_value_info(node.name, TensorProto.FLOAT, shape))
        if len(shape) == 4:
            nchw = self.emit("Transpose", [node.name], "nchw", perm=[0, 3, 1, 2])
            self.values[node.name] = (nchw, 4)
        else:
            self.values[node.name] = (node.name, len(shape))

    def op_Identity(self, node: TfjsNode) -> None:
        self.values[node.name] = self.value(node.inputs[0])

    def _fused_tail(
        self, node: TfjsNode, out: str, rank: int, fused: Sequence[str], bias: str | None
    ) -> None:
        for op in fused:
            if op == "BiasAdd":
                if bias is None:
                    raise self.fail(node, "fused BiasAdd without a bias input")
                out = self.emit("Add", [out, self.operand(bias, rank)], "bias")
            elif op == "Relu":
                out = self.emit("Relu", [out], "relu")
            elif op == "Relu6":
                out = self.emit(
                    "Clip",
                    [
                        out,
                        self.add_constant("zero", np.array(0, dtype=np.float32)),
                        self.add_constant("six", np.array(6, dtype=np.float32)),
                    ],
                    "relu6",
                )
            else:
                raise self.fail(node, f"unsupported fused op {op!r}")
        self.values[node.name] = (out, rank)

    def _conv(self, node: TfjsNode, depthwise: bool, fused: Sequence[str]) -> None:
        if node.string("data_format", "NHWC") != "NHWC":
            raise self.fail(node, "only NHWC convolutions are supported")
        padding = node.string("padding")
        if padding not in ("SAME", "VALID"):
            raise self.fail(node, f"padding {padding!r} is not supported (SAME or VALID)")
        strides = node.ints("strides") or [1, 1, 1, 1]
        dilations = node.ints("dilations") or [1, 1, 1, 1]
        if strides[0] != 1 or strides[3] != 1 or dilations[0] != 1 or dilations[3] != 1:
            raise self.fail(node, f"strides {strides} / dilations {dilations} over batch or channels")
        x, rank = self.value(node.inputs[0])
        if rank != 4:
            raise self.fail(node, f"input of rank {rank}, expected 4")
        kernel = self.constant_of(_tensor_name(node.inputs[1]))
        if kernel is None or kernel.ndim != 4:
            raise self.fail(node, "the filter must be a 4-d constant")
        kh, kw, cin, cout = kernel.shape
        if depthwise:
            # [H, W, C, M] -> [C*M, 1, H, W] with group C: output channel c*M+m, as TF orders them.
            weight = kernel.transpose(2, 3, 0, 1).reshape(cin * cout, 1, kh, kw)
            group = cin
        else:
            weight = kernel.transpose(3, 2, 0, 1)  # HWIO -> OIHW
            group = 1
        out = self.emit(
            "Conv",
            [x, self.add_constant(node.name.replace("/", "_") + "_w", weight.astype(np.float32))],
            "conv",
            kernel_shape=[kh, kw],
            strides=strides[1:3],
            dilations=dilations[1:3],
            group=group,
            auto_pad="SAME_UPPER" if padding == "SAME" else "VALID",
        )
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        self._fused_tail(node, out, 4, fused, bias)

    def op_Conv2D(self, node: TfjsNode) -> None:
        self._conv(node, depthwise=False, fused=())

    def op_DepthwiseConv2dNative(self, node: TfjsNode) -> None:
        self._conv(node, depthwise=True, fused=())

    def op__FusedConv2D(self, node: TfjsNode) -> None:
        self._conv(node, depthwise=False, fused=node.strings("fused_ops"))

    def op_FusedDepthwiseConv2dNative(self, node: TfjsNode) -> None:
        self._conv(node, depthwise=True, fused=node.strings("fused_ops"))

    def op__FusedMatMul(self, node: TfjsNode) -> None:
        if node.flag("transpose_a"):
            raise self.fail(node, "transpose_a is not supported")
        x, rank = self.value(node.inputs[0])
        if rank != 2:
            raise self.fail(node, f"input of rank {rank}, expected 2")
        kernel = self.constant_of(_tensor_name(node.inputs[1]))
        if kernel is None or kernel.ndim != 2:
            raise self.fail(node, "the matrix must be a 2-d constant")
        if node.flag("transpose_b"):
            kernel = kernel.T
        out = self.emit(
            "MatMul", [x, self.add_constant(node.name.replace("/", "_") + "_w", kernel)], "matmul"
        )
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        self._fused_tail(node, out, 2, node.strings("fused_ops"), bias)

    def _binary(self, node: TfjsNode, op: str) -> None:
        if len(node.inputs) != 2:
            raise self.fail(node, f"expected 2 inputs, got {len(node.inputs)}")
        constant = [self.constant_of(_tensor_name(i)) is not None for i in node.inputs]
        if all(constant):
            raise self.fail(node, "an op on two constants (not folded by the TFJS converter)")
        rank = max(self.value(i)[1] for i, c in zip(node.inputs, constant, strict=True) if not c)
        operands = [self.operand(i, rank) for i in node.inputs]
        self.values[node.name] = (self.emit(op, operands, op.lower()), rank)

    def op_Add(self, node: TfjsNode) -> None:
        self._binary(node, "Add")

    op_AddV2 = op_Add
    op_BiasAdd = op_Add

    def op_Sub(self, node: TfjsNode) -> None:
        self._binary(node, "Sub")

    def op_Mul(self, node: TfjsNode) -> None:
        self._binary(node, "Mul")

    def op_Minimum(self, node: TfjsNode) -> None:
        self._binary(node, "Min")

    def op_Maximum(self, node: TfjsNode) -> None:
        self._binary(node, "Max")

    def _unary(self, node: TfjsNode, op: str, **attrs: Any) -> None:
        x, rank = self.value(node.inputs[0])
        self.values[node.name] = (self.emit(op, [x], op.lower(), **attrs), rank)

    def op_Relu(self, node: TfjsNode) -> None:
        self._unary(node, "Relu")

    def op_Sigmoid(self, node: TfjsNode) -> None:
        self._unary(node, "Sigmoid")

    def op_Relu6(self, node: TfjsNode) -> None:
        x, rank = self.value(node.inputs[0])
        clipped = self.emit(
            "Clip",
            [
                x,
                self.add_constant("zero", np.array(0, dtype=np.float32)),
                self.add_constant("six", np.array(6, dtype=np.float32)),
            ],
            "relu6",
        )
        self.values[node.name] = (clipped, rank)

    def op_Softmax(self, node: TfjsNode) -> None:
        x, rank = self.value(node.inputs[0])
        if rank != 2:
            raise self.fail(node, f"softmax over a rank-{rank} tensor is not supported")
        self.values[node.name] = (self.emit("Softmax", [x], "softmax", axis=-1), rank)

    def op_Mean(self, node: TfjsNode) -> None:
        x, rank = self.value(node.inputs[0])
        axes = self.constant_of(_tensor_name(node.inputs[1]))
        if axes is None or rank != 4:
            raise self.fail(node, "only a mean over constant axes of a 4-d tensor is supported")
        # NHWC axis -> NCHW axis.
        to_nchw = {0: 0, 1: 2, 2: 3, 3: 1}
        mapped = sorted(to_nchw[int(a) % 4] for a in np.asarray(axes).reshape(-1))
        keep = node.flag("keep_dims")
        if keep and mapped != [2, 3]:
            raise self.fail(node, f"keep_dims over axes {axes} would need a layout change")
        out = self.emit("ReduceMean", [x], "mean", axes=mapped, keepdims=int(keep))
        self.values[node.name] = (out, 4 if keep else rank - len(mapped))


def graph_to_onnx(graph: TfjsGraph, outputs: dict[str, str]) -> onnx.ModelProto:
    """ONNX model computing the given TF tensors (name -> ONNX output name); unused branches are left out."""
    converter = _Converter(graph)
    graph_outputs = []
    for tf_name, onnx_name in outputs.items():
        value, rank = converter.value(tf_name)
        if rank == 4:
            raise ModelFormatError(f"{graph.source}: output {tf_name} is 4-d; only 2-d outputs are supported")
        converter.nodes.append(
            helper.make_node("Identity", [value], [onnx_name], name=converter.fresh("out"))
        )
        graph_outputs.append(helper.make_tensor_value_info(onnx_name, TensorProto.FLOAT, ["N", None]))
    onnx_graph = helper.make_graph(
        converter.nodes, "tfjs", converter.inputs, graph_outputs, initializer=converter.initializers
    )
    model = helper.make_model(
        onnx_graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="facesearch-tfjs"
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model

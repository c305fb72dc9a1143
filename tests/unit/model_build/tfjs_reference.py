"""A slow, plain numpy interpreter of TFJS graph models, for tests only.

It works in TensorFlow's own NHWC layout, pads 'SAME' convolutions the way TensorFlow documents it
(total = max((ceil(in / stride) - 1) * stride + kernel - in, 0), the extra pixel after), and computes in
float64, so it shares nothing with the ONNX converter but the parsed weights: a converter bug in layout,
padding, broadcasting or fused ops shows up as a difference.
"""

from __future__ import annotations

import math

import numpy as np

from model_build.tfjs import TfjsGraph, TfjsNode


def _same_pads(size: int, kernel: int, stride: int) -> tuple[int, int]:
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad_input(x: np.ndarray, node: TfjsNode, kh: int, kw: int) -> tuple[np.ndarray, int, int]:
    strides = node.ints("strides") or [1, 1, 1, 1]
    sy, sx = strides[1], strides[2]
    if node.string("padding") == "SAME":
        top, bottom = _same_pads(x.shape[1], kh, sy)
        left, right = _same_pads(x.shape[2], kw, sx)
        x = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    return x, sy, sx


def _windows(x: np.ndarray, kh: int, kw: int, sy: int, sx: int) -> np.ndarray:
    """[N, OH, OW, kh, kw, C] views of every kernel window."""
    n, h, w, c = x.shape
    oh, ow = (h - kh) // sy + 1, (w - kw) // sx + 1
    s = x.strides
    return np.lib.stride_tricks.as_strided(
        x, (n, oh, ow, kh, kw, c), (s[0], s[1] * sy, s[2] * sx, s[1], s[2], s[3]), writeable=False
    )


def conv2d(x: np.ndarray, kernel: np.ndarray, node: TfjsNode) -> np.ndarray:
    kh, kw = kernel.shape[:2]
    padded, sy, sx = _pad_input(x, node, kh, kw)
    return np.einsum("nyxijc,ijco->nyxo", _windows(padded, kh, kw, sy, sx), kernel, optimize=True)


def depthwise(x: np.ndarray, kernel: np.ndarray, node: TfjsNode) -> np.ndarray:
    kh, kw, c, m = kernel.shape
    padded, sy, sx = _pad_input(x, node, kh, kw)
    out = np.einsum("nyxijc,ijcm->nyxcm", _windows(padded, kh, kw, sy, sx), kernel, optimize=True)
    return out.reshape(*out.shape[:3], c * m)


def _fused(value: np.ndarray, ops: list[str], bias: np.ndarray | None) -> np.ndarray:
    for op in ops:
        if op == "BiasAdd":
            assert bias is not None
            value = value + bias
        elif op == "Relu":
            value = np.maximum(value, 0)
        elif op == "Relu6":
            value = np.clip(value, 0, 6)
        else:
            raise NotImplementedError(op)
    return value


def run(graph: TfjsGraph, feeds: dict[str, np.ndarray], output: str) -> np.ndarray:
    values: dict[str, np.ndarray] = {}
    for name, array in graph.weights.items():
        values[name] = array.astype(np.float64) if array.dtype.kind == "f" else array
    for name, array in feeds.items():
        values[name] = array.astype(np.float64)
    by_name = {node.name: node for node in graph.nodes}

    def get(reference: str) -> np.ndarray:
        name = reference.split(":")[0]
        if name not in values:
            evaluate(by_name[name])
        return values[name]

    def evaluate(node: TfjsNode) -> None:
        args = [get(i) for i in node.inputs]
        bias = args[2] if len(args) > 2 else None
        fused = node.strings("fused_ops")
        op = node.op
        if op == "Identity":
            result = args[0]
        elif op in ("Add", "AddV2", "BiasAdd"):
            result = args[0] + args[1]
        elif op == "Sub":
            result = args[0] - args[1]
        elif op == "Mul":
            result = args[0] * args[1]
        elif op == "Minimum":
            result = np.minimum(args[0], args[1])
        elif op == "Maximum":
            result = np.maximum(args[0], args[1])
        elif op == "Relu":
            result = np.maximum(args[0], 0)
        elif op == "Relu6":
            result = np.clip(args[0], 0, 6)
        elif op == "Sigmoid":
            result = 1 / (1 + np.exp(-args[0]))
        elif op == "Softmax":
            shifted = np.exp(args[0] - args[0].max(axis=-1, keepdims=True))
            result = shifted / shifted.sum(axis=-1, keepdims=True)
        elif op == "Mean":
            result = args[0].mean(
                axis=tuple(int(a) for a in args[1].reshape(-1)), keepdims=node.flag("keep_dims")
            )
        elif op in ("Conv2D", "_FusedConv2D"):
            result = _fused(conv2d(args[0], args[1], node), fused, bias)
        elif op in ("DepthwiseConv2dNative", "FusedDepthwiseConv2dNative"):
            result = _fused(depthwise(args[0], args[1], node), fused, bias)
        elif op == "_FusedMatMul":
            kernel = args[1].T if node.flag("transpose_b") else args[1]
            result = _fused(args[0] @ kernel, fused, bias)
        else:
            raise NotImplementedError(op)
        values[node.name] = result

    return get(output)

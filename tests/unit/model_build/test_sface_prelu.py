"""model_build.sface's PRelu rewrite against ONNX Runtime's own PRelu, on small synthetic graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from model_build.sface import without_prelu

CHANNELS = 8
SIZE = 12
# Slopes on both sides of 0 and of 1: 1 - s < 0 takes the sign-restoring Mul of the two-convolution form.
SLOPES = np.array([-0.8, -0.1, 0.0, 0.25, 0.5, 0.9, 1.0, 1.12], dtype=np.float32)


def conv_norm_prelu(in_channels: int, kernel: int, group: int, slopes: np.ndarray) -> onnx.ModelProto:
    """x -> Conv -> BatchNormalization -> PRelu, every weight a seeded random constant."""
    rng = np.random.default_rng(7)
    constants = {
        "w": rng.normal(size=(CHANNELS, in_channels // group, kernel, kernel)).astype(np.float32),
        "b": rng.normal(size=CHANNELS).astype(np.float32),
        "gamma": rng.uniform(0.5, 2.0, CHANNELS).astype(np.float32),
        "beta": rng.normal(size=CHANNELS).astype(np.float32),
        "mean": rng.normal(size=CHANNELS).astype(np.float32),
        "var": rng.uniform(0.1, 3.0, CHANNELS).astype(np.float32),
        "slope": slopes.reshape(CHANNELS, 1, 1),
    }
    pad = kernel // 2
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "w", "b"],
            ["z"],
            name="conv",
            group=group,
            kernel_shape=[kernel, kernel],
            pads=[pad] * 4,
        ),
        helper.make_node("BatchNormalization", ["z", "gamma", "beta", "mean", "var"], ["n"], name="norm"),
        helper.make_node("PRelu", ["n", "slope"], ["y"], name="prelu"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_norm_prelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, in_channels, SIZE, SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, SIZE, SIZE])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    outputs = [output.name for output in model.graph.output]
    nodes = without_prelu(list(model.graph.node), constants, graph_outputs=outputs)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:], out.graph.initializer[:]
    out.graph.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    out.graph.initializer.extend(
        numpy_helper.from_array(constants[name], name) for name in sorted(used & set(constants))
    )
    onnx.checker.check_model(out)
    return out


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], {"x": x})
    return np.asarray(y)


@pytest.mark.parametrize(
    ("in_channels", "kernel", "group", "convolutions"),
    [
        pytest.param(CHANNELS, 3, CHANNELS, 2, id="depthwise 3x3: two convolutions"),
        pytest.param(3, 3, 1, 2, id="3x3 over 3 channels (27 per output): two convolutions"),
        pytest.param(128, 1, 1, 1, id="1x1 over 128 channels: one convolution and the Relu sum"),
    ],
)
def test_the_rewrite_computes_prelu(in_channels: int, kernel: int, group: int, convolutions: int) -> None:
    model = conv_norm_prelu(in_channels, kernel, group, SLOPES)
    new = rewritten(model)
    ops = [node.op_type for node in new.graph.node]
    assert "PRelu" not in ops
    assert ops.count("Conv") == convolutions
    x = np.random.default_rng(3).normal(size=(1, in_channels, SIZE, SIZE)).astype(np.float32)
    expected = run(model, x)
    assert (expected < 0).any() and (expected > 0).any()
    np.testing.assert_allclose(run(new, x), expected, rtol=1e-5, atol=1e-4)


def test_the_sign_is_restored_only_where_a_slope_exceeds_1() -> None:
    above_one = rewritten(conv_norm_prelu(CHANNELS, 3, CHANNELS, SLOPES))
    at_most_one = rewritten(conv_norm_prelu(CHANNELS, 3, CHANNELS, np.clip(SLOPES, None, 1.0)))
    assert [node.op_type for node in above_one.graph.node].count("Mul") == 1
    assert [node.op_type for node in at_most_one.graph.node].count("Mul") == 0


@pytest.mark.parametrize("reader", ["a node", "the graph's output"])
def test_a_convolution_read_elsewhere_keeps_its_prelu_as_a_relu_sum(reader: str) -> None:
    model = conv_norm_prelu(CHANNELS, 3, CHANNELS, SLOPES)
    if reader == "a node":
        model.graph.node.append(helper.make_node("Identity", ["z"], ["z_copy"], name="other_reader"))
        model.graph.output.append(
            helper.make_tensor_value_info("z_copy", TensorProto.FLOAT, [1, CHANNELS, SIZE, SIZE])
        )
    else:
        model.graph.output.append(
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, CHANNELS, SIZE, SIZE])
        )
    new = rewritten(model)
    assert [node.op_type for node in new.graph.node].count("Conv") == 1
    x = np.random.default_rng(3).normal(size=(1, CHANNELS, SIZE, SIZE)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(model, x), rtol=1e-5, atol=1e-4)

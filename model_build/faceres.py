"""Graph rewrites of the converted faceres-deep age model (model_build.fetch applies them after the TFJS
conversion): the same function in ops ONNX Runtime runs faster on CPU."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_RELU6_LOW = "relu6_low"
_RELU6_HIGH = "relu6_high"


def relu6_as_clip(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each Relu -> Min(6) -> Max(0) chain (TFJS's Relu6, 27 of them) becomes one Clip(0, 6): the same
    function, which ONNX Runtime fuses into the convolution before it and keeps in its blocked (NCHWc) layout.
    As three ops they were 57 % of the model's CPU time (the Min and Max, and reordering the layout around
    them), measured on the CPU when this rewrite was added."""
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    producer = {output: node for node in model.graph.node for output in node.output}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1

    def constant_input(node: onnx.NodeProto, value: float) -> str | None:
        """The input of a two-input node that is not the scalar constant `value` (None if neither is)."""
        first, second = node.input
        for candidate, other in ((second, first), (first, second)):
            if (
                candidate in constants
                and constants[candidate].size == 1
                and constants[candidate].item() == value
            ):
                return str(other)
        return None

    replaced: dict[str, onnx.NodeProto] = {}  # the Max node's output -> its Clip
    dropped: set[str] = set()  # outputs of the Relu and Min nodes folded into a Clip
    for node in model.graph.node:
        if node.op_type != "Max" or len(node.input) != 2:
            continue
        minimum = producer.get(constant_input(node, 0.0) or "")
        if minimum is None or minimum.op_type != "Min" or len(minimum.input) != 2:
            continue
        relu = producer.get(constant_input(minimum, 6.0) or "")
        if relu is None or relu.op_type != "Relu":
            continue
        if readers.get(minimum.output[0]) != 1 or readers.get(relu.output[0]) != 1:
            continue  # an intermediate is read elsewhere: leave the chain as it is
        replaced[node.output[0]] = helper.make_node(
            "Clip", [relu.input[0], _RELU6_LOW, _RELU6_HIGH], [node.output[0]], name=f"{relu.name}_relu6"
        )
        dropped.update((relu.output[0], minimum.output[0]))
    if not replaced:
        return model
    nodes = []
    for node in model.graph.node:
        if node.output[0] in dropped:
            continue
        nodes.append(replaced.get(node.output[0], node))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), _RELU6_LOW),
            numpy_helper.from_array(np.array(6.0, dtype=np.float32), _RELU6_HIGH),
        ]
    )
    used = {name for node in out.graph.node for name in node.input}
    kept = [tensor for tensor in out.graph.initializer if tensor.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    onnx.checker.check_model(out)
    return out

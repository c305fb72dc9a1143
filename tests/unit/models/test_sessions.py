"""The ONNX Runtime session factory: provider choice, thread and spinning settings, warm-up."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models.sessions import SessionOptions, choose_providers, create_session


def doubling_model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_cpu_is_always_the_last_resort() -> None:
    assert choose_providers(["NoSuchExecutionProvider"]) == ["CPUExecutionProvider"]
    assert choose_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])[-1] == "CPUExecutionProvider"


@pytest.mark.parametrize(("allow_spinning", "expected"), [(False, "0"), (True, "1")])
def test_thread_and_spinning_settings_reach_the_session(allow_spinning: bool, expected: str) -> None:
    options = SessionOptions(intra_op_threads=2, inter_op_threads=1, allow_spinning=allow_spinning)
    session = create_session(doubling_model(), options)
    applied = session.get_session_options()
    assert applied.intra_op_num_threads == 2
    assert applied.get_session_config_entry("session.intra_op.allow_spinning") == expected
    assert session.get_providers()[-1] == "CPUExecutionProvider"


def test_spinning_is_off_by_default_and_results_do_not_depend_on_it() -> None:
    assert SessionOptions().allow_spinning is False
    batch = np.arange(12, dtype=np.float32).reshape(4, 3)
    outputs = [
        create_session(doubling_model(), SessionOptions(allow_spinning=spin), {"x": batch[:1]}).run(
            None, {"x": batch}
        )[0]
        for spin in (False, True)
    ]
    assert np.array_equal(outputs[0], batch * 2) and np.array_equal(outputs[1], batch * 2)

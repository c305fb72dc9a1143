"""The ONNX Runtime session factory: provider choice, thread and spinning settings, warm-up."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper

from models.analyzer import ModelConfig
from models.errors import ProviderUnavailable
from models.sessions import (
    SessionOptions,
    choose_providers,
    create_session,
    fixed_run_size,
    run_padded,
    warm_up,
)


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


@pytest.mark.parametrize(
    ("level", "mode", "expected_level", "expected_mode"),
    [
        ("all", "sequential", ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.ExecutionMode.ORT_SEQUENTIAL),
        ("basic", "parallel", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.ExecutionMode.ORT_PARALLEL),
    ],
)
def test_optimisation_level_and_execution_mode_reach_the_session(
    level: Literal["basic", "extended", "all"],
    mode: Literal["sequential", "parallel"],
    expected_level: ort.GraphOptimizationLevel,
    expected_mode: ort.ExecutionMode,
) -> None:
    # ONNX Runtime runs a parallel executor only with an inter-op pool (more than one thread).
    options = SessionOptions(graph_optimization=level, execution_mode=mode, inter_op_threads=2)
    applied = create_session(doubling_model(), options).get_session_options()
    assert applied.graph_optimization_level == expected_level
    assert applied.execution_mode == expected_mode
    defaults = SessionOptions()  # what won in bench/ort_settings.py
    assert (defaults.graph_optimization, defaults.execution_mode) == ("all", "sequential")


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


# -- a config that asks for CUDA on a machine without it (item 8 of issue 10) ----------------------------

GPU_CONFIG = Path(__file__).resolve().parents[3] / "config" / "serve-gpu.yaml"
CPU_CONFIG = GPU_CONFIG.with_name("serve.yaml")


def model_config_of(path: Path) -> dict[str, Any]:
    config = yaml.safe_load(path.read_text())
    return dict(config["applications"][0]["args"].get("model_config") or {})


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as ONNX Runtime's CPU build sees it, whatever package is installed."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])


@pytest.mark.usefixtures("cpu_only")
def test_gpu_config_without_cuda_fails_at_start_with_the_fix_in_the_message() -> None:
    config = ModelConfig.from_dict(model_config_of(GPU_CONFIG))
    with pytest.raises(ProviderUnavailable) as raised:
        create_session(doubling_model(), config.session_options())
    message = str(raised.value)
    assert "CUDAExecutionProvider" in message and "allow_cpu_fallback: true" in message


def test_cuda_listed_but_session_built_on_cpu_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # onnxruntime-gpu without usable CUDA libraries: CUDA is "available", the session quietly runs on CPU.
    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    real_session = ort.InferenceSession

    def cpu_session(source: Any, sess_options: Any = None, providers: Any = None) -> Any:
        return real_session(source, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", cpu_session)
    config = ModelConfig.from_dict(model_config_of(GPU_CONFIG))
    with pytest.raises(ProviderUnavailable, match="allow_cpu_fallback"):
        create_session(doubling_model(), config.session_options())


@pytest.mark.usefixtures("cpu_only")
def test_gpu_config_with_allow_cpu_fallback_runs_on_cpu_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    config = ModelConfig.from_dict({**model_config_of(GPU_CONFIG), "allow_cpu_fallback": True})
    batch = np.ones((2, 3), dtype=np.float32)
    with caplog.at_level(logging.WARNING, logger="models.sessions"):
        session = create_session(doubling_model(), config.session_options())
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert np.array_equal(session.run(None, {"x": batch})[0], batch * 2)
    assert any("CUDAExecutionProvider is not available" in record.getMessage() for record in caplog.records)


@pytest.mark.usefixtures("cpu_only")
def test_cpu_config_and_default_preference_are_unaffected(caplog: pytest.LogCaptureFixture) -> None:
    for model_config in (model_config_of(CPU_CONFIG), {}, {"provider_preference": ["CPUExecutionProvider"]}):
        config = ModelConfig.from_dict(model_config)
        with caplog.at_level(logging.WARNING, logger="models.sessions"):
            session = create_session(doubling_model(), config.session_options())
        assert session.get_providers() == ["CPUExecutionProvider"]
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


class RecordingSession:
    """A real CPU session that records the batch size of every run (what a GPU session would be given)."""

    def __init__(self) -> None:
        self.session = create_session(doubling_model(), SessionOptions())
        self.rows: list[int] = []

    def get_providers(self) -> list[str]:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def run(self, output_names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.rows.append(len(feed["x"]))
        return list(self.session.run(output_names, feed))


@pytest.mark.parametrize(("rows", "runs"), [(1, 1), (4, 1), (5, 2), (9, 3)])
def test_run_padded_gives_every_run_exactly_the_run_size_and_drops_the_padding(rows: int, runs: int) -> None:
    session = RecordingSession()
    batch = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 1
    (doubled,) = run_padded(session, ["y"], "x", batch, 4)
    assert np.array_equal(doubled, batch * 2)
    assert session.rows == [4] * runs


def test_run_size_zero_runs_the_batch_as_it_comes() -> None:
    session = RecordingSession()
    batch = np.ones((7, 3), dtype=np.float32)
    (doubled,) = run_padded(session, ["y"], "x", batch, 0)
    assert np.array_equal(doubled, batch * 2) and session.rows == [7]


def test_only_an_accelerator_session_pads() -> None:
    options = SessionOptions(gpu_run_size=16)
    assert fixed_run_size(create_session(doubling_model(), options), options) == 0
    assert fixed_run_size(RecordingSession(), options) == 16


def test_cuda_gets_the_configured_convolution_search(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    asked: list[Any] = []
    real_session = ort.InferenceSession

    def recording_session(source: Any, sess_options: Any = None, providers: Any = None) -> Any:
        asked.extend(providers)
        return real_session(source, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", recording_session)
    config = ModelConfig.from_dict(
        {**model_config_of(GPU_CONFIG), "allow_cpu_fallback": True, "cuda_conv_algo_search": "heuristic"}
    )
    create_session(doubling_model(), config.session_options())
    assert asked == [
        ("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"}),
        "CPUExecutionProvider",
    ]


def test_detector_runs_images_and_the_face_models_faces() -> None:
    config = ModelConfig.from_dict({"gpu_image_run_size": 4, "gpu_face_run_size": 32})
    assert config.session_options(config.gpu_image_run_size).gpu_run_size == 4
    assert config.session_options(config.gpu_face_run_size).gpu_run_size == 32
    assert ModelConfig().session_options().gpu_run_size == 0


def test_warm_up_runs_at_the_run_size_on_an_accelerator() -> None:
    accelerator = RecordingSession()
    warm_up(accelerator, SessionOptions(gpu_run_size=4), {"x": np.ones((2, 3), dtype=np.float32)})
    warm_up(accelerator, SessionOptions(gpu_run_size=4), {"x": np.ones((6, 3), dtype=np.float32)})
    warm_up(accelerator, SessionOptions(gpu_run_size=0), {"x": np.ones((2, 3), dtype=np.float32)})
    assert accelerator.rows == [4, 4, 2]

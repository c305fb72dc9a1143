"""The ingress replica loads no model library: importing its deployment (in a fresh interpreter, as a Serve
replica does) must not import dlib, OpenCV, ONNX Runtime or the model runners."""

from __future__ import annotations

import json
import subprocess
import sys

# Model libraries and the modules of models/ that load them (models.types, models.calibration and
# models.age_policy are plain numpy and stay allowed).
FORBIDDEN = (
    "dlib",
    "cv2",
    "onnxruntime",
    "onnx",
    "models.analyzer",
    "models.detector",
    "models.embedder",
    "models.sessions",
    "model_build",
    "model_build.fetch",
    "models.age_v2",
    "serve_app.wiring.worker",
    "serve_app.pipelines.worker",
)


def _modules_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_ingress_deployment_imports_no_model_library() -> None:
    loaded = _modules_after_import("serve_app.deployments.ingress")
    assert "serve_app.api.app" in loaded  # it did import the ingress' own code
    assert sorted(loaded & set(FORBIDDEN)) == []


def test_the_worker_side_does_load_them() -> None:
    # The check above can fail: the same probe sees the model libraries where they belong.
    loaded = _modules_after_import("serve_app.deployments.models")
    assert {"cv2", "onnxruntime", "dlib", "models.analyzer"} <= loaded

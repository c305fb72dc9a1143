"""The service never builds its models: the runtime packages do not load the build tooling (model_build,
npm, the converters), and a model runner whose converted file is missing fails at start naming the
command that builds it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models import weights
from models.analyzer import ModelConfig, load_runner
from models.errors import WeightFileError
from models.registry import Stage

REPO = Path(__file__).resolve().parents[2]


def _runtime_modules() -> list[str]:
    names = []
    for package in ("models", "serve_app"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _modules_after_import(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300, cwd=REPO
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _build_modules(loaded: set[str]) -> list[str]:
    return sorted(name for name in loaded if name == "model_build" or name.startswith("model_build."))


def test_no_runtime_module_loads_the_build_tooling() -> None:
    runtime = _runtime_modules()
    assert {"models.runners", "serve_app.deployments.models", "serve_app.launch.cli"} <= set(runtime)
    loaded = _modules_after_import(runtime)
    assert set(runtime) <= loaded  # every runtime module did import
    assert _build_modules(loaded) == []


def test_the_build_tooling_is_what_loads_it() -> None:
    # The probe above can fail: it sees the build modules where they are imported.
    assert "model_build.npm_fetch" in _build_modules(_modules_after_import(["model_build.fetch"]))


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a runner must not run npm or anything else."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a model runner started a process: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(shutil, "which", refuse)


@pytest.mark.parametrize(
    ("stage", "missing"),
    [
        ("embedder", "dlib_resnet_v1"),
        ("age", "faceres_deep"),
        ("analysis", "yunet_2023mar_int8bq"),  # analysis loads its detector first
    ],
)
@pytest.mark.usefixtures("no_subprocess")
def test_a_runner_without_its_converted_model_fails_at_start_naming_the_command(
    stage: Stage, missing: str, tmp_path: Path
) -> None:
    with pytest.raises(WeightFileError) as raised:
        load_runner(stage, ModelConfig(models_dir=tmp_path))
    message = str(raised.value)
    assert str(tmp_path / weights.CONVERTED[missing].file_name) in message
    assert "is missing" in message
    assert "`facesearch models fetch`" in message and "`make install`" in message
    assert list(tmp_path.iterdir()) == []  # nothing fetched, nothing converted


@pytest.mark.usefixtures("no_subprocess")
def test_a_converted_model_with_another_hash_is_refused_naming_the_command(tmp_path: Path) -> None:
    spec = weights.CONVERTED["faceres_deep"]
    (tmp_path / spec.file_name).write_bytes(b"not the converted model")
    with pytest.raises(WeightFileError, match=r"has sha256 [0-9a-f]{64}, expected " + spec.sha256) as raised:
        load_runner("age", ModelConfig(models_dir=tmp_path))
    assert "`facesearch models fetch`" in str(raised.value)

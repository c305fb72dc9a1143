"""The image's dependency layer (deploy/image/requirements.py) installs pyproject.toml's pins, and the GPU
variant swaps onnxruntime for onnxruntime-gpu at the same pinned version."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from deploy.image.requirements import requirements

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared() -> list[str]:
    with PYPROJECT.open("rb") as handle:
        dependencies: list[str] = tomllib.load(handle)["project"]["dependencies"]
    return dependencies


def test_cpu_variant_installs_the_declared_dependencies() -> None:
    assert requirements(PYPROJECT, "cpu") == declared()


def test_gpu_variant_swaps_in_onnxruntime_gpu_at_the_pinned_version() -> None:
    cpu = [spec.replace(" ", "") for spec in declared()]
    gpu = requirements(PYPROJECT, "gpu")
    (pin,) = [spec for spec in cpu if spec.startswith("onnxruntime==")]
    assert "onnxruntime-gpu==" + pin.removeprefix("onnxruntime==") in gpu
    assert not any(spec.startswith("onnxruntime==") for spec in gpu)
    assert [spec for spec in gpu if not spec.startswith("onnxruntime")] == [
        spec for spec in cpu if not spec.startswith("onnxruntime")
    ]


def test_gpu_variant_refuses_a_project_without_an_onnxruntime_pin(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["numpy==2.4.6", "onnxruntime>=1.20"]\n')
    with pytest.raises(SystemExit, match="onnxruntime"):
        requirements(pyproject, "gpu")

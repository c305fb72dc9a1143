"""The image's dependency layer (deploy/image/requirements.py) installs pyproject.toml's pins, and the GPU
variant's onnxruntime-gpu has the version pinned for onnxruntime."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from deploy.image.requirements import check_variant, dependencies, gpu_wheel

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_dependency_layer_installs_the_declared_dependencies() -> None:
    with PYPROJECT.open("rb") as handle:
        declared = tomllib.load(handle)["project"]["dependencies"]
    assert dependencies(PYPROJECT) == declared


def test_the_gpu_wheel_has_the_version_pinned_for_onnxruntime() -> None:
    (pin,) = [spec for spec in dependencies(PYPROJECT) if spec.startswith("onnxruntime")]
    version = pin.split("==")[1]
    assert gpu_wheel(PYPROJECT) == f"onnxruntime-gpu=={version}"


def test_a_project_without_an_exact_onnxruntime_pin_is_refused(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["numpy==2.4.6", "onnxruntime>=1.20"]\n')
    with pytest.raises(SystemExit, match="onnxruntime"):
        gpu_wheel(pyproject)


@pytest.mark.parametrize(
    ("variant", "providers", "accepted"),
    [
        ("cpu", ["CPUExecutionProvider"], True),
        ("gpu", ["CUDAExecutionProvider", "CPUExecutionProvider"], True),
        # The CPU wheel left in place of the GPU one (a dependency pulled it in after onnxruntime-gpu).
        ("gpu", ["AzureExecutionProvider", "CPUExecutionProvider"], False),
        ("cpu", ["CUDAExecutionProvider", "CPUExecutionProvider"], False),
    ],
)
def test_the_build_stops_when_the_installed_wheel_is_not_the_variant(
    variant: str, providers: list[str], accepted: bool
) -> None:
    if accepted:
        check_variant(variant, providers, "1.30.0")
    else:
        with pytest.raises(SystemExit, match=f"variant {variant}"):
            check_variant(variant, providers, "1.30.0")

"""The image's pinned Python dependencies, read from pyproject.toml (its one source of truth).

    python3.11 requirements.py pyproject.toml              # the dependencies, one per line
    python3.11 requirements.py pyproject.toml --gpu-wheel  # onnxruntime-gpu at the onnxruntime pin
    /opt/venv/bin/python requirements.py pyproject.toml --check cpu|gpu  # the installed wheel is that variant

Installing the dependencies before the source is copied keeps that layer cached across code changes. The GPU
variant then replaces the onnxruntime wheel by onnxruntime-gpu of the same version (see the Dockerfile).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

_ORT_PIN = re.compile(r"^onnxruntime\s*==\s*([^;\s]+)$")


def dependencies(pyproject: Path) -> list[str]:
    with pyproject.open("rb") as handle:
        declared: list[str] = tomllib.load(handle)["project"]["dependencies"]
    return declared


def gpu_wheel(pyproject: Path) -> str:
    """onnxruntime-gpu==X for the project's onnxruntime==X."""
    for spec in dependencies(pyproject):
        match = _ORT_PIN.match(spec.strip())
        if match:
            return f"onnxruntime-gpu=={match.group(1)}"
    raise SystemExit(f"{pyproject} pins no onnxruntime==X to match with onnxruntime-gpu")


def check_variant(variant: str, providers: list[str], version: str) -> None:
    """Stop unless the installed onnxruntime is the variant's wheel: the GPU build lists the CUDA provider
    whether or not a GPU and the CUDA libraries are present, the CPU build never does."""
    if ("CUDAExecutionProvider" in providers) != (variant == "gpu"):
        raise SystemExit(f"variant {variant}, but onnxruntime {version} lists {providers}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The image's pinned Python dependencies.")
    parser.add_argument("pyproject", type=Path)
    parser.add_argument(
        "--gpu-wheel", action="store_true", help="print onnxruntime-gpu at the onnxruntime pin"
    )
    parser.add_argument("--check", choices=("cpu", "gpu"), help="check the installed onnxruntime wheel")
    options = parser.parse_args(argv)
    if options.check:
        import onnxruntime as ort  # only where the venv is built

        check_variant(options.check, ort.get_available_providers(), ort.__version__)
        return 0
    lines = [gpu_wheel(options.pyproject)] if options.gpu_wheel else dependencies(options.pyproject)
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Print the service's pinned dependencies from pyproject.toml, one per line (the image's dependency layer).

Installing them before the source is copied keeps that layer cached across code changes. `--variant gpu`
swaps `onnxruntime==X` for `onnxruntime-gpu==X`: both wheels write the same `onnxruntime/` package, and the
version stays pinned in one place (pyproject.toml).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

_ORT = re.compile(r"^onnxruntime(==[^;\s]+)$")


def requirements(pyproject: Path, variant: str) -> list[str]:
    with pyproject.open("rb") as handle:
        dependencies: list[str] = tomllib.load(handle)["project"]["dependencies"]
    if variant == "cpu":
        return dependencies
    swapped = [_ORT.sub(r"onnxruntime-gpu\1", spec.replace(" ", "")) for spec in dependencies]
    if not any(spec.startswith("onnxruntime-gpu==") for spec in swapped):
        raise SystemExit("pyproject.toml pins no onnxruntime==X to swap for onnxruntime-gpu")
    return swapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--variant", choices=("cpu", "gpu"), default="cpu")
    options = parser.parse_args(argv)
    sys.stdout.write("".join(f"{spec}\n" for spec in requirements(options.pyproject, options.variant)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

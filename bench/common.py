"""Helpers shared by the benchmarks: dev photos read the way the service decodes uploads, tables, timings."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
from PIL import Image, ImageOps


def load_image(path: Path) -> np.ndarray:
    """uint8 pixels with EXIF orientation applied; grayscale and RGBA stay as they are (the analyzer
    converts them), palette and other modes become RGB."""
    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)
        if image.mode not in ("L", "RGB", "RGBA"):
            image = image.convert("RGB")
        return np.asarray(image, dtype=np.uint8).copy()


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, ["-" * width for width in widths], *rows]
    ]
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of the values; NaN for none."""
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


_Arg = TypeVar("_Arg")


def best_seconds(run: Callable[[_Arg], object], argument: _Arg, repeats: int) -> float:
    """Minimum wall time of `repeats` calls, after one untimed call (first-shape allocations)."""
    run(argument)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run(argument)
        times.append(time.perf_counter() - started)
    return min(times)


def tile_to(chips: np.ndarray, count: int) -> np.ndarray:
    """`count` chips taken cyclically from the real ones, so every batch holds real faces."""
    return chips[np.arange(count) % len(chips)]

"""Helpers shared by the benchmarks: reading dev photos the way the service decodes uploads."""

from __future__ import annotations

from pathlib import Path

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

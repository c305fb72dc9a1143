"""Helpers shared by the benchmarks: dev photos read the way the service decodes uploads, a scratch Redis."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def scratch_redis() -> Iterator[str]:
    """A redis-server of the project's own (127.0.0.1) in a temporary directory for one benchmark; its URL."""
    # Imported here: the model-only benchmarks (bench.gpu) run where the service's packages are not installed.
    from serve_app.launch.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="facesearch-bench-redis-") as directory:
        server = EmbeddedRedis(Path(directory) / "redis")
        server.start()
        try:
            yield server.url
        finally:
            server.stop()

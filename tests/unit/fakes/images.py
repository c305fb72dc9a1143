"""Test images."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

from PIL import Image

from tests.unit.fakes.models import (
    Color,
)


def image_bytes(image: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def solid_png(color: Color, size: tuple[int, int] = (16, 16)) -> bytes:
    return image_bytes(Image.new("RGB", size, color), "PNG")


def uniform_png(width: int, height: int, bit_depth: int, color_type: int, row: bytes | None = None) -> bytes:
    """A PNG written by hand, every scanline the same: huge dimensions stay small on disk and in memory.

    color_type: 0 gray, 2 RGB, 3 palette (a two-colour PLTE is added), 4 gray+alpha, 6 RGBA.
    """
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    row_bytes = (width * channels * bit_depth + 7) // 8
    scanline = b"\x00" + (row if row is not None else bytes(row_bytes))
    assert len(scanline) == row_bytes + 1

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload))
            + kind
            + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)
        )

    compressor = zlib.compressobj(9)
    compressed = b"".join(compressor.compress(scanline) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    palette = chunk(b"PLTE", bytes([0, 0, 0, 255, 255, 255])) if color_type == 3 else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + palette
        + chunk(b"IDAT", compressed)
        + chunk(b"IEND", b"")
    )


def jpeg(size: tuple[int, int] = (32, 24), color: Color = (120, 90, 60)) -> bytes:
    return image_bytes(Image.new("RGB", size, color), "JPEG", quality=90)

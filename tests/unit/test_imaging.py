"""Image sniffing and decoding: formats by magic bytes, every accepted mode to 8-bit RGB, EXIF, limits."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from serve_app.domain.errors import PayloadTooLarge, UnsupportedMedia, ValidationFailed
from serve_app.imaging.decode import DecodedImage, ImageFormat, decode_image, sniff_format, validate_image
from tests.unit.fakes import image_bytes, uniform_png

LIMIT = 40_000_000
RED = (255, 0, 0)
BLUE = (0, 0, 255)


def decode(data: bytes, max_side: int | None = None, max_pixels: int = LIMIT) -> np.ndarray:
    decoded = decode_image(data, max_pixels, max_side)
    assert isinstance(decoded, DecodedImage)
    pixels = decoded.pixels
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
    return pixels


def two_halves(size: tuple[int, int] = (40, 20)) -> Image.Image:
    """Left half red, right half blue."""
    image = Image.new("RGB", size, RED)
    image.paste(BLUE, (size[0] // 2, 0, size[0], size[1]))
    return image


def close(actual: np.ndarray, expected: tuple[int, int, int], tolerance: int = 12) -> bool:
    return bool(np.all(np.abs(actual.astype(int) - np.array(expected)) <= tolerance))


# ------------------------------------------------------------------------------------------ sniffing


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (image_bytes(Image.new("RGB", (4, 4)), "PNG"), ImageFormat("png", "image/png")),
        (image_bytes(Image.new("RGB", (4, 4)), "JPEG"), ImageFormat("jpeg", "image/jpeg")),
        (b"\xff\xd8\xff\xe0rest does not matter to sniffing", ImageFormat("jpeg", "image/jpeg")),
    ],
)
def test_sniffing_recognises_jpeg_and_png_by_their_signature(data: bytes, expected: ImageFormat) -> None:
    assert sniff_format(data) == expected


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(image_bytes(Image.new("P", (4, 4)), "GIF"), id="GIF"),
        pytest.param(image_bytes(Image.new("RGB", (4, 4)), "WEBP"), id="WebP"),
        pytest.param(image_bytes(Image.new("RGB", (4, 4)), "BMP"), id="BMP"),
        pytest.param(image_bytes(Image.new("RGB", (4, 4)), "TIFF"), id="TIFF"),
        pytest.param(image_bytes(Image.new("RGB", (4, 4)), "ICO"), id="ICO"),
        pytest.param(b'<svg xmlns="http://www.w3.org/2000/svg"/>', id="SVG"),
        pytest.param(b"%PDF-1.7\n", id="PDF"),
        pytest.param(b"hello, this is text", id="text"),
        pytest.param(b"\x89PNG", id="half a PNG signature"),
        pytest.param(b"\xff\xd8", id="half a JPEG signature"),
    ],
)
def test_sniffing_refuses_everything_else(data: bytes) -> None:
    with pytest.raises(UnsupportedMedia):
        sniff_format(data)
    with pytest.raises(UnsupportedMedia):
        decode_image(data, LIMIT)


def test_an_empty_file_is_a_validation_error() -> None:
    with pytest.raises(ValidationFailed) as error:
        sniff_format(b"")
    assert error.value.details == {"file": "empty file"}


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(
            b"\x89PNG\r\n\x1a\n" + image_bytes(Image.new("P", (4, 4)), "GIF"), id="PNG magic, GIF body"
        ),
        pytest.param(b"\xff\xd8\xff" + b"\x00" * 64, id="JPEG magic, zeros"),
        pytest.param(image_bytes(Image.new("RGB", (64, 64), RED), "PNG")[:60], id="truncated PNG"),
    ],
)
def test_a_valid_signature_on_a_broken_file_is_a_validation_error(data: bytes) -> None:
    with pytest.raises(ValidationFailed):
        decode_image(data, LIMIT)


def test_a_truncated_jpeg_fails_at_decode_not_later() -> None:
    noise = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = image_bytes(Image.fromarray(noise), "JPEG")
    decode(data)
    with pytest.raises(ValidationFailed):
        decode_image(data[: len(data) * 2 // 3], LIMIT)


# ----------------------------------------------------------------------------------------- modes


def test_rgb_png_is_returned_exactly() -> None:
    pixels = np.random.default_rng(2).integers(0, 256, (12, 17, 3), dtype=np.uint8)
    decoded = decode_image(image_bytes(Image.fromarray(pixels), "PNG"), LIMIT)
    assert decoded.format == ImageFormat("png", "image/png")
    assert np.array_equal(decoded.pixels, pixels)


def test_grayscale_png_becomes_equal_channels() -> None:
    gray = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    pixels = decode(image_bytes(Image.fromarray(gray, mode="L"), "PNG"))
    for channel in range(3):
        assert np.array_equal(pixels[:, :, channel], gray)


def test_bilevel_png_becomes_black_and_white() -> None:
    pixels = decode(uniform_png(8, 2, 1, 0, bytes([0b11110000])))
    assert pixels.shape == (2, 8, 3)
    assert pixels[0, :4].tolist() == [[255, 255, 255]] * 4
    assert pixels[0, 4:].tolist() == [[0, 0, 0]] * 4


def test_16_bit_grayscale_png_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257 * 64, 257 * 128, 65535]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    pixels = decode(image_bytes(image, "PNG"))
    assert pixels[0, :, 0].tolist() == [0, 64, 128, 255]
    assert np.array_equal(pixels[:, :, 0], pixels[:, :, 2])


def test_16_bit_rgb_png_keeps_the_high_bytes() -> None:
    row = b"".join(bytes([high, 0x11]) for high in (250, 128, 3, 0, 77, 200))  # two pixels, 16-bit samples
    pixels = decode(uniform_png(2, 3, 16, 2, row))
    assert pixels.shape == (3, 2, 3)
    assert pixels[1].tolist() == [[250, 128, 3], [0, 77, 200]]


def test_transparency_is_composited_onto_white() -> None:
    rgba = Image.new("RGBA", (3, 1))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    rgba.putpixel((1, 0), (10, 20, 30, 0))
    rgba.putpixel((2, 0), (0, 0, 0, 128))
    pixels = decode(image_bytes(rgba, "PNG"))
    assert pixels[0, 0].tolist() == [10, 20, 30]
    assert pixels[0, 1].tolist() == [255, 255, 255]
    assert close(pixels[0, 2], (127, 127, 127), tolerance=2)

    gray_alpha = Image.new("LA", (2, 1))
    gray_alpha.putpixel((0, 0), (40, 255))
    gray_alpha.putpixel((1, 0), (40, 0))
    pixels = decode(image_bytes(gray_alpha, "PNG"))
    assert pixels[0].tolist() == [[40, 40, 40], [255, 255, 255]]


def test_palette_png_with_and_without_a_transparent_index() -> None:
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    opaque = decode(image_bytes(palette, "PNG"))
    assert opaque[0].tolist() == [[0, 0, 0], [200, 100, 50]]
    transparent = decode(image_bytes(palette, "PNG", transparency=0))
    assert transparent[0].tolist() == [[255, 255, 255], [200, 100, 50]]


def test_cmyk_jpeg_becomes_rgb() -> None:
    image = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # pure red in CMYK
    data = image_bytes(image, "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    pixels = decode(data)
    assert close(pixels[8, 8], RED)


def test_mpo_jpeg_from_a_phone_camera_decodes_its_first_frame() -> None:
    data = image_bytes(
        Image.new("RGB", (32, 16), RED),
        "MPO",
        save_all=True,
        append_images=[Image.new("RGB", (32, 16), BLUE)],
    )
    decoded = decode_image(data, LIMIT)
    assert decoded.format == ImageFormat("jpeg", "image/jpeg")
    assert decoded.pixels.shape == (16, 32, 3)
    assert close(decoded.pixels[8, 16], RED)


# ------------------------------------------------------------------------------------- orientation


@pytest.mark.parametrize(
    ("orientation", "shape", "top_left", "bottom_right"),
    [
        (1, (20, 40, 3), RED, BLUE),  # as stored
        (3, (20, 40, 3), BLUE, RED),  # rotated 180 degrees
        (6, (40, 20, 3), RED, BLUE),  # rotate 90 clockwise: left half becomes the top
        (8, (40, 20, 3), BLUE, RED),  # rotate 90 counter-clockwise: right half becomes the top
        (2, (20, 40, 3), BLUE, RED),  # mirrored left-right
    ],
)
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_orientation_is_applied(
    fmt: str,
    orientation: int,
    shape: tuple[int, int, int],
    top_left: tuple[int, int, int],
    bottom_right: tuple[int, int, int],
) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = image_bytes(two_halves(), fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))
    pixels = decode(data)
    assert pixels.shape == shape
    assert close(pixels[2, 2], top_left), pixels[2, 2]
    assert close(pixels[-3, -3], bottom_right), pixels[-3, -3]


# ------------------------------------------------------------------------------------------- limits


def test_max_side_downscales_the_longest_side_keeping_the_aspect_ratio() -> None:
    data = image_bytes(two_halves((400, 200)), "PNG")
    assert decode(data, max_side=100).shape == (50, 100, 3)
    assert decode(data, max_side=400).shape == (200, 400, 3)
    assert decode(data, max_side=1000).shape == (200, 400, 3)  # never upscaled
    assert decode(data).shape == (200, 400, 3)
    small = decode(data, max_side=100)
    assert close(small[25, 10], RED) and close(small[25, 90], BLUE)


def test_max_side_applies_after_the_exif_rotation() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    pixels = decode(image_bytes(two_halves((400, 200)), "JPEG", exif=exif, quality=95), max_side=100)
    assert pixels.shape == (100, 50, 3)
    assert close(pixels[10, 25], RED) and close(pixels[90, 25], BLUE)


def test_the_pixel_limit_is_inclusive_and_checked_before_decoding() -> None:
    data = uniform_png(100, 100, 8, 0)
    assert decode(data, max_pixels=10_000).shape == (100, 100, 3)
    with pytest.raises(PayloadTooLarge):
        decode_image(data, 9_999)


@pytest.mark.parametrize(
    ("width", "height"),
    [(8_000, 8_000), (20_000, 20_000), (1, 50_000_000)],
    ids=["64 MP palette-sized", "400 MP beyond Pillow's own limit", "one pixel wide"],
)
def test_decompression_bombs_are_payload_too_large(width: int, height: int) -> None:
    data = uniform_png(width, height, 1, 0) if height < 1_000_000 else _tall_png_header_only(width, height)
    with pytest.raises(PayloadTooLarge) as error:
        decode_image(data, LIMIT)
    assert error.value.details == {"file": "image too large"}


def _tall_png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR announces a huge image and whose data is cut short: refused by size, not by damage."""
    full = uniform_png(width, 1, 1, 0)
    header_end = 8 + 25  # signature + IHDR chunk
    ihdr = bytearray(full[:header_end])
    ihdr[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    crc = zlib.crc32(bytes(ihdr[12:29])) & 0xFFFFFFFF
    ihdr[29:33] = crc.to_bytes(4, "big")
    return bytes(ihdr) + full[header_end:]


# --------------------------------------------------------------------------- validate_image (the API's check)


def _noise(size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "L": 1, "CMYK": 4}[mode]
    shape = (size[1], size[0], channels) if channels > 1 else (size[1], size[0])
    return Image.fromarray(np.random.default_rng(7).integers(0, 256, shape, dtype=np.uint8), mode=mode)


def _rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    _noise((64, 32)).save(buffer, "JPEG", exif=exif)
    return buffer.getvalue()


def _progressive_jpeg() -> bytes:
    buffer = io.BytesIO()
    _noise((300, 200)).save(buffer, "JPEG", progressive=True, quality=90)
    return buffer.getvalue()


_VALIDATION_CORPUS: dict[str, bytes] = {
    "jpeg 1x1": image_bytes(_noise((1, 1)), "JPEG"),
    "jpeg 7x5": image_bytes(_noise((7, 5)), "JPEG"),
    "jpeg 640x480": image_bytes(_noise((640, 480)), "JPEG"),
    "jpeg grayscale": image_bytes(_noise((120, 90), "L"), "JPEG"),
    "jpeg cmyk": image_bytes(_noise((120, 90), "CMYK"), "JPEG"),
    "jpeg progressive": _progressive_jpeg(),
    "jpeg exif-rotated": _rotated_jpeg(),
    "png rgb": image_bytes(_noise((80, 60)), "PNG"),
    "png 16-bit": image_bytes(Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16)), "PNG"),
    "png magic, gif body": b"\x89PNG\r\n\x1a\n" + image_bytes(Image.new("P", (4, 4)), "GIF"),
    "jpeg magic, zeros": b"\xff\xd8\xff" + b"\x00" * 64,
    "gif": image_bytes(Image.new("P", (4, 4)), "GIF"),
}
for _name, _data in list(_VALIDATION_CORPUS.items()):
    if _name.startswith(("jpeg ", "png ")):
        for _share in (0.3, 0.6, 0.9, 0.98):
            _VALIDATION_CORPUS[f"{_name} cut at {_share:.0%}"] = _data[: int(len(_data) * _share)]


def _outcome(check: object, data: bytes, max_pixels: int) -> str:
    try:
        check(data, max_pixels)  # type: ignore[operator]
    except (ValidationFailed, UnsupportedMedia, PayloadTooLarge) as error:
        return type(error).__name__
    return "accepted"


@pytest.mark.parametrize("name", sorted(_VALIDATION_CORPUS))
def test_validation_agrees_with_a_full_decode(name: str) -> None:
    """The API checks uploads with the cheap validate_image and the worker decodes them fully: a file one
    accepts and the other refuses would be a 202 that can only end as a failed transaction."""
    data = _VALIDATION_CORPUS[name]
    assert _outcome(validate_image, data, LIMIT) == _outcome(decode_image, data, LIMIT)


def test_validation_refuses_truncated_jpegs_and_oversized_images() -> None:
    data = _VALIDATION_CORPUS["jpeg 640x480"]
    assert validate_image(data, LIMIT) == ImageFormat("jpeg", "image/jpeg")
    with pytest.raises(ValidationFailed):
        validate_image(data[: len(data) // 2], LIMIT)
    with pytest.raises(PayloadTooLarge):
        validate_image(data, 640 * 480 - 1)


def test_a_large_jpeg_is_decoded_at_reduced_scale_to_the_same_picture() -> None:
    """decode_image with max_side lets the JPEG decoder skip detail the downscale would drop anyway; the
    result must be the size the plain downscale gives and look the same."""
    y, x = np.mgrid[0:3000, 0:4000]
    smooth = np.stack([(x // 16) % 256, (y // 12) % 256, ((x + y) // 20) % 256], axis=-1).astype(np.uint8)
    data = image_bytes(Image.fromarray(smooth), "JPEG")
    reduced = decode_image(data, LIMIT, max_side=1920).pixels
    full = Image.open(io.BytesIO(data)).convert("RGB")
    full.thumbnail((1920, 1920), Image.Resampling.BILINEAR)
    expected = np.asarray(full)
    assert reduced.shape == expected.shape == (1440, 1920, 3)
    assert float(np.mean(np.abs(reduced.astype(int) - expected.astype(int)))) < 3.0


def _smooth_jpeg(width: int, height: int, exif: Image.Exif | None = None) -> bytes:
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x // 16) % 256, (y // 12) % 256, ((x + y) // 20) % 256], axis=-1).astype(np.uint8)
    image = Image.fromarray(pixels)
    image.paste(BLUE, (width // 2, 0, width, height))  # right half blue, to see the orientation
    return image_bytes(image, "JPEG", **({"exif": exif} if exif is not None else {}))


def _decoded_sizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(height, width) of every picture handed to the final resampling, i.e. as libjpeg decoded it."""
    import serve_app.imaging.decode as decode_module

    seen: list[tuple[int, int]] = []
    shrink = decode_module._shrink

    def spy(pixels: np.ndarray, max_side: int) -> np.ndarray:
        seen.append((pixels.shape[0], pixels.shape[1]))
        return shrink(pixels, max_side)

    monkeypatch.setattr(decode_module, "_shrink", spy)
    return seen


def test_a_jpeg_twice_the_size_limit_is_decoded_reduced_a_smaller_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _decoded_sizes(monkeypatch)
    # 4000 px: libjpeg decodes at 1/2 (2000 px, still above 1920), the rest is resampled.
    assert decode(_smooth_jpeg(4000, 3000), max_side=1920).shape == (1440, 1920, 3)
    assert seen == [(1500, 2000)]
    # 2048 px: half scale would fall below 1920 px, so the full picture is decoded, then resampled.
    seen.clear()
    assert decode(_smooth_jpeg(2048, 1364), max_side=1920).shape == (1279, 1920, 3)
    assert seen == [(1364, 2048)]
    # Within the limit: decoded as it is, never resampled.
    seen.clear()
    assert decode(_smooth_jpeg(1280, 960), max_side=1920).shape == (960, 1280, 3)
    assert seen == []


def test_exif_orientation_holds_for_a_jpeg_decoded_reduced(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _decoded_sizes(monkeypatch)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise: the stored right half (blue) becomes the bottom
    pixels = decode(_smooth_jpeg(4000, 2000, exif=exif), max_side=1920)
    assert seen == [(2000, 1000)]  # decoded at 1/2, after the rotation
    assert pixels.shape == (1920, 960, 3)
    assert close(pixels[-20, 480], BLUE) and not close(pixels[20, 480], BLUE)


def _plain_jpeg_path(monkeypatch: pytest.MonkeyPatch, *, enabled: bool = True) -> list[bool]:
    """Spy on (or switch off) the OpenCV path of decode_image; records whether each call decoded."""
    import serve_app.imaging.decode as decode_module

    taken: list[bool] = []
    original = decode_module._decode_plain_jpeg

    def spy(data: bytes, image: Image.Image, scale: int) -> np.ndarray | None:
        pixels = original(data, image, scale) if enabled else None
        taken.append(pixels is not None)
        return pixels

    monkeypatch.setattr(decode_module, "_decode_plain_jpeg", spy)
    return taken


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize(
    ("size", "max_side", "mode"),
    [
        ((160, 120), None, "RGB"),  # decoded whole
        ((1600, 1200), 700, "RGB"),  # 1/2
        ((1600, 1200), 400, "RGB"),  # 1/4
        ((1600, 1200), 200, "L"),  # 1/8, grayscale
    ],
)
def test_opencv_decodes_a_plain_jpeg_to_pillows_pixels(
    orientation: int, size: tuple[int, int], max_side: int | None, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain-JPEG path (OpenCV) must be the one such a file takes, and give exactly what Pillow gives,
    EXIF orientation and libjpeg's reduced scales included."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    image = two_halves(size) if mode == "RGB" else _noise(size, "L")
    data = image_bytes(image, "JPEG", exif=exif)
    taken = _plain_jpeg_path(monkeypatch)
    fast = decode(data, max_side=max_side)
    assert taken == [True]
    _plain_jpeg_path(monkeypatch, enabled=False)
    assert np.array_equal(fast, decode(data, max_side=max_side))


def _with_byte_orientation(jpeg: bytes, orientation: int) -> bytes:
    """The JPEG with an EXIF block whose Orientation is stored as a BYTE (the EXIF standard says SHORT)."""
    entry = struct.pack("<HHHI", 1, 0x0112, 1, 1) + bytes([orientation, 0, 0, 0]) + struct.pack("<I", 0)
    payload = b"Exif\x00\x00" + b"II*\x00" + struct.pack("<I", 8) + entry
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


@pytest.mark.parametrize("orientation", [3, 6])
def test_an_orientation_pillow_cannot_read_leaves_the_picture_as_stored_on_both_paths(
    orientation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pillow reads a BYTE orientation as bytes, not a number, and leaves the picture as it is stored;
    OpenCV would turn it. What a file decodes to must not depend on which path takes it."""
    data = _with_byte_orientation(image_bytes(two_halves(), "JPEG"), orientation)
    taken = _plain_jpeg_path(monkeypatch)
    fast = decode(data)
    assert taken == [True]
    assert fast.shape == (20, 40, 3) and close(fast[10, 5], RED) and close(fast[10, 35], BLUE)
    _plain_jpeg_path(monkeypatch, enabled=False)
    assert np.array_equal(fast, decode(data))


@pytest.mark.parametrize(
    "name",
    ["cmyk", "trailing bytes", "cut short"],
)
def test_other_jpegs_are_left_to_pillow(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = image_bytes(_noise((64, 48)), "JPEG")
    data = {
        "cmyk": image_bytes(_noise((64, 48), "CMYK"), "JPEG"),
        "trailing bytes": plain + b"trailer",
        "cut short": plain[: len(plain) * 2 // 3],
    }[name]
    taken = _plain_jpeg_path(monkeypatch)
    if name == "cut short":
        with pytest.raises(ValidationFailed):  # Pillow's refusal, whatever OpenCV would make of it
            decode_image(data, LIMIT)
    else:
        assert decode(data).shape == (48, 64, 3)
    assert taken == [False]


def test_an_opencv_failure_leaves_the_file_to_pillow(monkeypatch: pytest.MonkeyPatch) -> None:
    import cv2

    def refuse(*args: object) -> None:
        raise cv2.error("refused")

    monkeypatch.setattr(cv2, "imdecode", refuse)
    pixels = decode(image_bytes(two_halves(), "JPEG"))
    assert pixels.shape == (20, 40, 3) and close(pixels[10, 5], RED) and close(pixels[10, 35], BLUE)

"""Validate and decode uploaded images.

The file's magic bytes decide its type, never its name or declared content type, so a GIF named .png or a
text file named .jpg is refused before any decoder runs. Decoding honours EXIF orientation and converts
grayscale, palette, RGBA, CMYK and 16-bit images to 8-bit RGB.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from serve_app.domain.errors import PayloadTooLarge, UnsupportedMedia, ValidationFailed

_SIGNATURES: tuple[tuple[bytes, str, str], ...] = (
    (b"\xff\xd8\xff", "jpeg", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png", "image/png"),
)
ACCEPTED_EXTENSIONS = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class ImageFormat:
    name: str  # jpeg | png
    content_type: str


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # uint8 [H, W, 3] RGB, EXIF orientation applied
    format: ImageFormat


def sniff_format(data: bytes) -> ImageFormat:
    if not data:
        raise ValidationFailed("The image file is empty.", {"file": "empty file"})
    for signature, name, content_type in _SIGNATURES:
        if data.startswith(signature):
            return ImageFormat(name, content_type)
    raise UnsupportedMedia(
        "The file is not a JPEG or PNG image.", {"file": "only .jpg, .jpeg and .png images are accepted"}
    )


def validate_image(data: bytes, max_pixels: int) -> ImageFormat:
    """Check an upload the way decode_image would (type, pixel limit, a complete and decodable file) at a
    fraction of the cost: JPEGs are decoded at 1/8 scale, which still reads every byte of the file, and no
    colour conversion or EXIF rotation is done. For the API, which must refuse a bad file but never looks at
    its pixels."""
    image_format = sniff_format(data)
    with _decoding(max_pixels):
        image = _open(data, max_pixels)
        _draft(image, 8)
        image.load()
    return image_format


def decode_image(data: bytes, max_pixels: int, max_side: int | None = None) -> DecodedImage:
    """Decode fully (a truncated file fails here, not later in a worker) and return RGB pixels.

    max_side, when given, downscales the result so its longest side is at most that many pixels. A JPEG is
    first decoded by libjpeg at the smallest of 1/2, 1/4, 1/8 scale that keeps the longest side at least
    max_side, so the faces keep the resolution max_side allows; what is left (less than 2x) is resampled.
    Decoding a 12 MP photo at half scale costs about a quarter of the full decode.
    """
    image_format = sniff_format(data)
    with _decoding(max_pixels):
        image = _open(data, max_pixels)
        width, height = image.size
        scale = max(width, height) // max_side if max_side is not None else 1
        scale = _draft(image, scale) if scale > 1 else 1
        pixels = _decode_plain_jpeg(data, image, scale)
        if pixels is None:
            image.load()
    if pixels is None:
        # In place: with no orientation to undo, exif_transpose would return a full copy of the pixels (and
        # convert("RGB") another one for an image that is RGB already): 3.9 -> 3.3 ms of CPU per dev photo.
        ImageOps.exif_transpose(image, in_place=True)
        pixels = np.asarray(_to_rgb(image), dtype=np.uint8)
    if max_side is not None and max(pixels.shape[:2]) > max_side:
        pixels = _shrink(pixels, max_side)
    return DecodedImage(pixels=pixels, format=image_format)


# What ImageOps.exif_transpose does for each EXIF orientation, as a NumPy view of [H, W, C] pixels. Any
# other value (a malformed tag: out of range, or not an integer) leaves the picture as stored, as Pillow does.
_ORIENTATIONS: dict[object, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda pixels: pixels[:, ::-1],  # FLIP_LEFT_RIGHT
    3: lambda pixels: pixels[::-1, ::-1],  # ROTATE_180
    4: lambda pixels: pixels[::-1],  # FLIP_TOP_BOTTOM
    5: lambda pixels: pixels.transpose(1, 0, 2),  # TRANSPOSE
    6: lambda pixels: np.rot90(pixels, -1),  # ROTATE_270 (counter-clockwise)
    7: lambda pixels: pixels[::-1, ::-1].transpose(1, 0, 2),  # TRANSVERSE
    8: lambda pixels: np.rot90(pixels, 1),  # ROTATE_90
}


def _decode_plain_jpeg(data: bytes, image: Image.Image, scale: int) -> np.ndarray | None:
    """RGB pixels of a plain JPEG decoded by OpenCV at 1/scale, or None where Pillow must do it.

    Both wrap libjpeg-turbo with the same settings, but OpenCV decodes straight into a NumPy array, while
    Pillow keeps RGB as 4 bytes per pixel and copies it out: 3.5 -> 3.0-3.2 ms of CPU per dev identity
    photo. The pixels are the same to the bit (all 3,344 JPEGs of faces-dev, faces-calib and faces-wild;
    the tests hold it for every reduced scale and EXIF orientation). `image` is the opened file, not yet
    loaded. Only a YCbCr or grayscale JPEG whose data ends in the end-of-image marker takes this path, so a
    CMYK, multi-picture or truncated file, or anything OpenCV refuses, is decoded (or refused) by Pillow.
    The orientation is Pillow's reading of the EXIF tag on both paths: OpenCV reads a malformed tag (one
    stored as a byte, say) that Pillow ignores, so its own rotation is switched off."""
    if image.format != "JPEG" or image.mode not in ("RGB", "L") or not data.endswith(b"\xff\xd9"):
        return None
    import cv2  # not at module level: see _shrink

    # The REDUCED_GRAYSCALE flags carry only the scale here; IMREAD_COLOR_RGB asks for three channels.
    reduced = {
        1: 0,
        2: cv2.IMREAD_REDUCED_GRAYSCALE_2,
        4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
        8: cv2.IMREAD_REDUCED_GRAYSCALE_8,
    }
    flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION | reduced[scale]
    try:
        pixels: np.ndarray | None = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flags)
    except cv2.error:
        return None  # Pillow decides, with the API's errors
    width, height = image.size  # after draft(): the reduced size
    if pixels is None or pixels.shape != (height, width, 3):
        return None
    orient = _ORIENTATIONS.get(image.getexif().get(ExifTags.Base.Orientation))
    return np.ascontiguousarray(orient(pixels)) if orient is not None else pixels


def _shrink(pixels: np.ndarray, max_side: int) -> np.ndarray:
    """Scale so the longest side is max_side. Pillow's antialiased resize cost more than the decode itself
    (22 ms for 2048 -> 1920 px, 51 ms for 3000 -> 1920 px on the 2-core box); OpenCV's bilinear
    takes 3-4 ms and reads every source pixel while the factor stays under 2, which the JPEG decoder's own
    reduction ensures. Larger factors (PNG) average areas instead, so nothing aliases."""
    # Imported here: the ingress imports this module for validate_image and must not load OpenCV.
    import cv2

    height, width = pixels.shape[:2]
    scale = max_side / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    interpolation = cv2.INTER_LINEAR if scale >= 0.5 else cv2.INTER_AREA
    shrunk: np.ndarray = cv2.resize(pixels, size, interpolation=interpolation)
    return shrunk


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Open the file (its header only) and enforce the pixel limit and the format."""
    with warnings.catch_warnings():
        # Pillow warns, then errors, on decompression bombs; we enforce our own limit below instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image: Image.Image = Image.open(io.BytesIO(data))
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"The image has {width}x{height} pixels; the limit is {max_pixels} pixels.",
            {"file": "image too large"},
        )
    # Pillow calls a JPEG with an MPF segment (many phone cameras) "MPO"; frame 0 is the photo.
    if image.format not in ("JPEG", "MPO", "PNG"):
        raise UnsupportedMedia("The file is not a JPEG or PNG image.", {"file": "unsupported format"})
    return image


def _draft(image: Image.Image, scale: int) -> int:
    """Have libjpeg decode a JPEG at a reduced DCT scale (a no-op for PNG): the largest of 1/2, 1/4, 1/8
    that keeps the image at least 1/scale of its size, which Pillow picks. Returns the scale chosen."""
    width, height = image.size
    if scale <= 1 or image.format not in ("JPEG", "MPO"):
        return 1
    drafted = image.draft(None, (max(1, width // scale), max(1, height // scale)))
    # Pillow answers with the original picture's box in the reduced one's coordinates: width / scale.
    return 1 if drafted is None else round(width / drafted[1][2])


@contextlib.contextmanager
def _decoding(max_pixels: int) -> Iterator[None]:
    """Pillow's and the decoders' failures as the API's errors."""
    try:
        yield
    except (PayloadTooLarge, UnsupportedMedia):
        raise
    except Image.DecompressionBombError as error:
        # Raised by Image.open itself for images far beyond Pillow's own limit, before our check runs.
        raise PayloadTooLarge(
            f"The image has too many pixels; the limit is {max_pixels} pixels.", {"file": "image too large"}
        ) from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ValidationFailed(
            "The image could not be decoded (corrupt or truncated file).",
            {"file": "corrupt or truncated image"},
        ) from error


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grayscale: scale to 8 bits rather than clipping, which would turn most photos white.
        array = np.asarray(image, dtype=np.float64)
        peak = float(array.max()) or 1.0
        scale = 255.0 / (65535.0 if peak > 255 else 255.0)
        image = Image.fromarray(np.clip(array * scale, 0, 255).astype(np.uint8), mode="L")
    elif image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Composite transparency onto white so transparent regions do not become black.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image if image.mode == "RGB" else image.convert("RGB")

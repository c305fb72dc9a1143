"""Decode time by photo size: what the worker pays to turn an uploaded JPEG into the analysed pixels.

    python -m bench.decode [--max-side 1920] [--rounds 5]

Generated photo-like JPEGs (smooth gradients plus noise, quality 90) from 640x480 to 6000x4000 px, and the
large dev photos. Columns, milliseconds per photo (best of --rounds): the full-size decode with no limit;
libjpeg alone at the scale decode_image picks; decode_image with the service's max side as it is now
(reduced decoding, then OpenCV's bilinear for the rest); and the same reduced decoding followed by
Pillow's antialiased thumbnail, as decode_image resampled before. Then the size handed to the models.

With --models, the dev photos larger than the max side (the only ones of faces-dev, faces-calib and
faces-wild whose pixels the change touches: every other photo is decoded unchanged) also go through the
models both ways, and the table shows the largest face's detector box, fused cosine and age each way.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from PIL import Image, ImageOps

from bench.common import format_table
from serve_app.imaging.decode import decode_image
from serve_app.settings import Settings
from tests.faces_dev import load_faces_dev

SIZES = ((640, 480), (1280, 960), (2048, 1365), (3000, 2000), (4032, 3024), (6000, 4000))
LIMIT = 100_000_000


def photo_like_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def best_ms(call: Callable[[], object], rounds: int) -> float:
    call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def libjpeg_only(data: bytes, max_side: int) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    if max(width, height) > max_side:
        scale = max(width, height) // max_side
        image.draft(None, (width // scale, height // scale))
    image.load()
    return image


def pillow_thumbnail(data: bytes, max_side: int) -> np.ndarray:
    """decode_image's former resampling: the same reduced decode, then Pillow's antialiased thumbnail."""
    image = libjpeg_only(data, max_side)
    image = (ImageOps.exif_transpose(image) or image).convert("RGB")
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side), Image.Resampling.BILINEAR)
    return np.asarray(image)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-side", type=int, default=Settings.from_env().models.analysis_max_side)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", action="store_true", help="compare the models' results both ways")
    args = parser.parse_args()
    photos = [(f"generated {w}x{h}", photo_like_jpeg(w, h)) for w, h in SIZES]
    dev = load_faces_dev()
    for item in dev.of_kind("identity"):
        with Image.open(item.path) as image:
            large = image.format == "JPEG" and max(image.size) > args.max_side
        if large:
            photos.append(
                (f"faces-dev {item.path.name} {image.size[0]}x{image.size[1]}", item.path.read_bytes())
            )
    rows = []
    for name, data in photos:
        full = best_ms(partial(decode_image, data, LIMIT), args.rounds)
        reduced = libjpeg_only(data, args.max_side)
        libjpeg = best_ms(partial(libjpeg_only, data, args.max_side), args.rounds)
        now = best_ms(partial(decode_image, data, LIMIT, args.max_side), args.rounds)
        before = best_ms(partial(pillow_thumbnail, data, args.max_side), args.rounds)
        shape = decode_image(data, LIMIT, args.max_side).pixels.shape
        rows.append(
            [
                name,
                f"{len(data) // 1024}",
                f"{full:.1f}",
                f"{reduced.size[0]}x{reduced.size[1]}",
                f"{libjpeg:.1f}",
                f"{now:.1f}",
                f"{before:.1f}",
                f"{shape[1]}x{shape[0]}",
            ]
        )
    header = [
        "photo",
        "KiB",
        "full decode",
        "libjpeg scale",
        "libjpeg ms",
        "decode_image",
        "with Pillow resize",
    ]
    print(f"max side {args.max_side} px; ms per photo, best of {args.rounds}")
    print(format_table([*header, "analysed size"], rows))
    if args.models:
        print()
        print(model_table([data for name, data in photos if name.startswith("faces-dev")], args.max_side))


def model_table(uploads: list[bytes], max_side: int) -> str:
    """The largest face of each photo analysed from both decodes: box, fused cosine, age."""
    from models.analyzer import ModelConfig, load_face_analyzer
    from models.types import largest_face

    analyzer = load_face_analyzer(ModelConfig())
    rows = []
    for data in uploads:
        faces = []
        for pixels in (decode_image(data, LIMIT, max_side).pixels, pillow_thumbnail(data, max_side)):
            face = largest_face(analyzer.analyze([pixels])[0])
            assert face is not None and face.embedding is not None and face.age is not None
            faces.append(face)
        now, before = faces
        assert now.embedding is not None and before.embedding is not None
        assert now.age is not None and before.age is not None
        rows.append(
            [
                " ".join(f"{v:.0f}" for v in now.detection.box),
                " ".join(f"{v:.0f}" for v in before.detection.box),
                f"{float(now.embedding @ before.embedding):.4f}",
                f"{now.age.expected_age:.2f}",
                f"{before.age.expected_age:.2f}",
            ]
        )
    header = ["box now", "box with Pillow resize", "fused cosine", "age now", "age before"]
    return format_table(header, rows)


if __name__ == "__main__":
    main()

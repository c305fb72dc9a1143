"""Small array helpers shared by the model runners."""

from __future__ import annotations

import numpy as np


def to_rgb(image: np.ndarray) -> np.ndarray:
    """Return a C-contiguous HxWx3 uint8 RGB view or copy of `image`.

    Accepts HxW or HxWx1 grayscale, HxWx3 RGB and HxWx4 RGBA (all uint8). RGBA is composited over white:
    the colour of fully transparent pixels is undefined (often black), and a cut-out portrait is meant to
    be seen over a light background, which is also what a person uploading it saw.
    """
    if image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 image, got dtype {image.dtype}")
    if image.ndim == 2:
        rgb = np.repeat(image[:, :, None], 3, axis=2)
    elif image.ndim == 3 and image.shape[2] == 1:
        rgb = np.repeat(image, 3, axis=2)
    elif image.ndim == 3 and image.shape[2] == 3:
        rgb = image
    elif image.ndim == 3 and image.shape[2] == 4:
        alpha = image[:, :, 3:4].astype(np.uint16)
        # Integer blend with rounding: colour*a + 255*(255-a), divided by 255.
        blended = (image[:, :, :3].astype(np.uint16) * alpha + 255 * (255 - alpha) + 127) // 255
        rgb = blended.astype(np.uint8)
    else:
        raise ValueError(f"expected an HxW, HxWx1, HxWx3 or HxWx4 image, got shape {image.shape}")
    if rgb.shape[0] == 0 or rgb.shape[1] == 0:
        raise ValueError(f"image has no pixels (shape {image.shape})")
    return np.ascontiguousarray(rgb)


def flatten_views(views: np.ndarray, size: int, what: str) -> tuple[np.ndarray, int, int]:
    """(uint8 [N*V, size, size, 3], N, V) from views [N, V, size, size, 3], or [N, size, size, 3] meaning
    one view per face: the layout every age runner takes, checked once here."""
    if views.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8, got {views.dtype}")
    if views.ndim == 4:
        views = views[:, None]
    if views.ndim != 5 or views.shape[2:] != (size, size, 3):
        raise ValueError(
            f"{what} must be [N, V, {size}, {size}, 3] or [N, {size}, {size}, 3], got {views.shape}"
        )
    faces, count = int(views.shape[0]), int(views.shape[1])
    if faces and count == 0:
        raise ValueError(f"{what} need at least one view per face")
    return views.reshape(faces * count, size, size, 3), faces, count

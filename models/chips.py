"""Face chips aligned by a similarity transform from YuNet's five landmarks to the ArcFace template.

SFace (like every ArcFace-style descriptor) was trained on 112x112 crops made this way: the five points
(right eye, left eye, nose tip, right and left mouth corner, in YuNet's order, i.e. image-left eye first)
are mapped by the least-squares similarity (rotation, uniform scale, translation; Umeyama 1991) onto fixed
template positions. The quality gate measures sharpness on the same chip, so both use this one module.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

from models.arrays import to_rgb

CHIP_SIZE = 112
# The standard ArcFace / InsightFace 5-point template for 112x112 crops (image-left eye first).
ARCFACE_TEMPLATE = np.asarray(
    [
        [38.2946, 51.6963],
        [73.5318, 51.5014],
        [56.0252, 71.7366],
        [41.5493, 92.3655],
        [70.7299, 92.2041],
    ],
    dtype=np.float64,
)


def similarity_transform(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """2x3 matrix M of the similarity that best maps source points onto target points (least squares,
    no reflection): target ~ M @ [x, y, 1]. Umeyama's closed form, in float64."""
    src = np.asarray(source, dtype=np.float64).reshape(-1, 2)
    dst = np.asarray(target, dtype=np.float64).reshape(-1, 2)
    if src.shape != dst.shape or src.shape[0] < 2:
        raise ValueError(f"need matching point sets of at least 2 points, got {src.shape} and {dst.shape}")
    src_mean, dst_mean = src.mean(axis=0), dst.mean(axis=0)
    src_c, dst_c = src - src_mean, dst - dst_mean
    covariance = dst_c.T @ src_c / len(src)
    u, singular, vt = np.linalg.svd(covariance)
    sign = np.ones(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[-1] = -1.0  # the best orthogonal map would be a reflection; take the best rotation instead
    rotation = u @ np.diag(sign) @ vt
    variance = (src_c**2).sum() / len(src)
    scale = float((singular * sign).sum() / variance) if variance > 0 else 1.0
    translation = dst_mean - scale * rotation @ src_mean
    return np.hstack([scale * rotation, translation[:, None]])


def align_chip(rgb: np.ndarray, landmarks: np.ndarray, size: int = CHIP_SIZE) -> np.ndarray:
    """One aligned uint8 RGB chip [size, size, 3] for a face's five landmarks (original-image pixels)."""
    template = ARCFACE_TEMPLATE * (size / CHIP_SIZE)
    matrix = similarity_transform(np.asarray(landmarks, dtype=np.float64), template)
    scale = float(np.sqrt(abs(np.linalg.det(matrix[:, :2]))))
    if scale < _MAX_SHRINK:
        rgb, matrix = _prefilter(rgb, matrix, scale, size)
    return cv2.warpAffine(
        rgb, matrix, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0
    )


# Bilinear warping reads 2x2 pixels per output pixel, so shrinking a large face by more than about 2x
# aliases (sharp faces turn noisy); such faces are first reduced with area averaging.
_MAX_SHRINK = 0.5


def _prefilter(rgb: np.ndarray, matrix: np.ndarray, scale: float, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut the region the chip samples, shrink it by area averaging to about twice the chip's resolution,
    and return it with the matrix that maps the cut onto the chip."""
    inverse = cv2.invertAffineTransform(matrix)
    corners = np.asarray([[0, 0, 1], [size, 0, 1], [0, size, 1], [size, size, 1]], dtype=np.float64)
    source = corners @ inverse.T
    height, width = rgb.shape[:2]
    x0, y0 = (max(0, int(np.floor(v))) for v in source.min(axis=0))
    x1, y1 = (int(np.ceil(v)) for v in source.max(axis=0))
    x1, y1 = min(width, x1 + 1), min(height, y1 + 1)
    if x1 - x0 < 2 or y1 - y0 < 2:
        return rgb, matrix
    shrink = 2.0 * scale
    region = cv2.resize(rgb[y0:y1, x0:x1], None, fx=shrink, fy=shrink, interpolation=cv2.INTER_AREA)
    # chip = A @ (x0 + u / shrink, y0 + v / shrink) + t for a pixel (u, v) of the shrunk region.
    adjusted = matrix.copy()
    adjusted[:, :2] = matrix[:, :2] / shrink
    adjusted[:, 2] = matrix[:, :2] @ np.asarray([x0, y0], dtype=np.float64) + matrix[:, 2]
    return region, adjusted


def aligned_chips(image: np.ndarray, landmarks: Sequence[np.ndarray], size: int = CHIP_SIZE) -> np.ndarray:
    """Aligned chips for many faces of one image: uint8 [N, size, size, 3] RGB."""
    if not landmarks:
        return np.zeros((0, size, size, 3), dtype=np.uint8)
    rgb = to_rgb(image)
    return np.stack([align_chip(rgb, points, size) for points in landmarks]).astype(np.uint8, copy=False)

"""Photos made worse in steps (darker, blurrier, noisier, smaller, more compressed, low light), for the age
rules' degradation test and `python -m bench.age`: both must see the same copies.

Each step is deterministic (the noise is seeded by the caller), applied to a decoded RGB uint8 image.
Blur widths are fractions of the image's shorter side, so a 200 px crop and a 448 px photo lose the same
share of the face's detail.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Step:
    """One degradation at one strength; `apply(rgb, seed)` returns a new image."""

    kind: str
    level: int  # 1 = mildest
    label: str
    apply: Callable[[np.ndarray, int], np.ndarray]  # (rgb, seed) -> degraded rgb

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.level}"


def darker(rgb: np.ndarray, factor: float) -> np.ndarray:
    return np.clip(np.rint(rgb.astype(np.float32) * factor), 0, 255).astype(np.uint8)


def blurrier(rgb: np.ndarray, share: float) -> np.ndarray:
    sigma = share * min(rgb.shape[:2])
    return np.ascontiguousarray(cv2.GaussianBlur(rgb, (0, 0), sigma))


def noisier(rgb: np.ndarray, std: float, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, std, rgb.shape)
    return np.clip(np.rint(rgb + noise), 0, 255).astype(np.uint8)


def smaller(rgb: np.ndarray, side: int) -> np.ndarray:
    scale = side / min(rgb.shape[:2])
    if scale >= 1:
        return rgb
    size = (max(1, round(rgb.shape[1] * scale)), max(1, round(rgb.shape[0] * scale)))
    return np.ascontiguousarray(cv2.resize(rgb, size, interpolation=cv2.INTER_AREA))


def recompressed(rgb: np.ndarray, quality: int) -> np.ndarray:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=quality)
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


def low_light(rgb: np.ndarray, factor: float, std: float, share: float, seed: int) -> np.ndarray:
    """A dim, shaken, grainy photo (the issue's cleared teenager): darker, blurred, then noisy."""
    return noisier(blurrier(darker(rgb, factor), share), std, seed)


Degrade = Callable[[np.ndarray, int], np.ndarray]


def _darker(factor: float) -> Degrade:
    return lambda rgb, _seed: darker(rgb, factor)


def _blurrier(share: float) -> Degrade:
    return lambda rgb, _seed: blurrier(rgb, share)


def _noisier(std: float) -> Degrade:
    return lambda rgb, seed: noisier(rgb, std, seed)


def _smaller(side: int) -> Degrade:
    return lambda rgb, _seed: smaller(rgb, side)


def _recompressed(quality: int) -> Degrade:
    return lambda rgb, _seed: recompressed(rgb, quality)


def _low_light(factor: float, std: float, share: float) -> Degrade:
    return lambda rgb, seed: low_light(rgb, factor, std, share, seed)


def _steps() -> tuple[Step, ...]:
    steps: list[Step] = []
    for level, factor in enumerate((0.5, 0.3, 0.18, 0.1), 1):
        steps.append(Step("darker", level, f"x{factor:g}", _darker(factor)))
    for level, share in enumerate((0.005, 0.01, 0.02, 0.03), 1):
        steps.append(Step("blurrier", level, f"sigma {share:g} of side", _blurrier(share)))
    for level, std in enumerate((8.0, 12.0, 16.0, 24.0), 1):
        steps.append(Step("noisier", level, f"std {std:g}", _noisier(std)))
    for level, side in enumerate((96, 64, 48, 36), 1):
        steps.append(Step("smaller", level, f"{side} px side", _smaller(side)))
    for level, quality in enumerate((30, 15, 8, 4), 1):
        steps.append(Step("compressed", level, f"JPEG q{quality}", _recompressed(quality)))
    for level, (factor, std, share) in enumerate(
        ((0.35, 6.0, 0.005), (0.2, 10.0, 0.01), (0.12, 14.0, 0.02)), 1
    ):
        label = f"x{factor:g}, std {std:g}, blur {share:g}"
        steps.append(Step("low_light", level, label, _low_light(factor, std, share)))
    return tuple(steps)


DEGRADATIONS: tuple[Step, ...] = _steps()
KINDS: tuple[str, ...] = tuple(dict.fromkeys(step.kind for step in DEGRADATIONS))

"""Scripted model outputs: embeddings, analysed faces, a scripted analysis backend."""

from __future__ import annotations

import asyncio
import math

import numpy as np

from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality
from tests.unit.fakes.common import EMBEDDING_SIZE


def embedding(seed: int) -> np.ndarray:
    """A unit vector like face model v2's; different seeds are nearly orthogonal (|cosine| < 0.3)."""
    vector = np.random.default_rng(seed).normal(size=EMBEDDING_SIZE)
    return (vector / np.linalg.norm(vector)).astype(np.float32)


def at_cosine(base: np.ndarray, cosine: float, seed: int = 0) -> np.ndarray:
    """A unit vector whose cosine with the unit vector base is `cosine` (up to float32 rounding)."""
    unit = base.astype(np.float64) / np.linalg.norm(base)
    direction = np.random.default_rng(10_000 + seed).normal(size=EMBEDDING_SIZE)
    direction -= (direction @ unit) * unit
    direction /= np.linalg.norm(direction)
    return (cosine * unit + math.sqrt(max(0.0, 1.0 - cosine * cosine)) * direction).astype(np.float32)


def age_estimate(age: int) -> AgeEstimate:
    """The model's estimate of a face of this age (the flags are models.age_policy's)."""
    return AgeEstimate(
        age=age,
        expected_age=float(age),
        p_under_18=1.0 if age < 16 else 0.5 if age < 20 else 0.0,
        p_under_21=1.0 if age < 19 else 0.5 if age < 23 else 0.0,
    )


def face(
    vector: np.ndarray | None = None,
    age: int | None = None,
    size: float = 100.0,
    quality: FaceQuality | None = None,
    x: float = 10.0,
) -> AnalyzedFace:
    detection = DetectedFace(
        box=np.array([x, 10.0, x + size, 10.0 + size], dtype=np.float32),
        landmarks=np.zeros((5, 2), dtype=np.float32),
        score=0.99,
    )
    return AnalyzedFace(
        detection=detection,
        embedding=vector,
        age=age_estimate(age) if age is not None else None,
        quality=quality,
    )


def quality(
    enrol_ok: bool = True,
    search_ok: bool = True,
    reasons: tuple[str, ...] = (),
    sharpness: float = 200.0,
    texture: float = 1.5,
) -> FaceQuality:
    """A quality verdict as models.quality gives it (measurements of a plausible, well-lit face)."""
    return FaceQuality(
        face_size_px=120.0,
        detector_score=0.95,
        sharpness=sharpness,
        yaw=0.0,
        pitch=0.5,
        roll_deg=0.0,
        enrol_ok=enrol_ok,
        search_ok=search_ok,
        reasons=reasons,
        brightness=0.5,
        contrast=0.15,
        texture=texture,
        blockiness=1.2,
    )


def face_quality(ok: bool = True) -> FaceQuality:
    """A verdict passing every bar, or failing them all for blur (so blurred that the age interval is
    unbounded: the age rules read the measurements)."""
    return quality(
        enrol_ok=ok,
        search_ok=ok,
        reasons=() if ok else ("blurry",),
        sharpness=200.0 if ok else 5.0,
        texture=1.5 if ok else 0.1,
    )


Color = tuple[int, int, int]


class ScriptedAnalysis:
    """A FaceAnalysisBackend whose answer depends on the colour of the image's top-left pixel.

    Tests upload solid-colour PNGs (lossless), so each transaction can be given its own faces.
    """

    def __init__(self, faces_by_color: dict[Color, list[AnalyzedFace]] | None = None) -> None:
        self.faces_by_color = dict(faces_by_color or {})
        self.calls: list[tuple[Color, bool, bool]] = []
        self.failures: list[BaseException] = []  # raised by the next calls, in order
        self.gate: asyncio.Event | None = None  # when set up, analyze waits for it
        self.started = 0

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        self.started += 1
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        color: Color = (int(image[0, 0, 0]), int(image[0, 0, 1]), int(image[0, 0, 2]))
        self.calls.append((color, embed, estimate_age))
        await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            raise self.failures.pop(0)
        faces = self.faces_by_color.get(color, [])
        return [
            AnalyzedFace(
                detection=item.detection,
                embedding=item.embedding if embed else None,
                age=item.age if estimate_age else None,
                quality=item.quality,
            )
            for item in faces
        ]

"""What the pipelines need from the models, whichever process runs them."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import numpy as np

from models.types import AnalyzedFace

if TYPE_CHECKING:
    from models.analyzer import FaceAnalyzer


class FaceAnalysisBackend(Protocol):
    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        """Faces in one RGB uint8 image with their descriptors and/or age estimates."""


class ModelCallTimedOut(Exception):
    """A model call took longer than its deadline. Counted as a failed attempt (retried, then given up
    after max_deliveries), not as an outage: a call that always hangs on some image must end."""


class DeadlineAnalysis:
    """Bounds every analysis call, so one hung model call cannot hold a worker slot (and its lease)
    forever. Cancelling the awaiting task cancels the Serve handle request too."""

    def __init__(self, backend: FaceAnalysisBackend, timeout_s: float) -> None:
        self._backend = backend
        self._timeout_s = timeout_s

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        try:
            return await asyncio.wait_for(
                self._backend.analyze(image, embed=embed, estimate_age=estimate_age), self._timeout_s
            )
        except TimeoutError:
            raise ModelCallTimedOut(f"the model call took longer than {self._timeout_s:g} s") from None


class LocalAnalysis:
    """The face models in this process (command-line tools such as `facesearch reindex`), one image at a
    time in a worker thread so the event loop stays free."""

    def __init__(self, analyzer: FaceAnalyzer) -> None:
        self._analyzer = analyzer

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        faces = await asyncio.to_thread(self._analyzer.analyze, [image], embed, estimate_age)
        return faces[0]

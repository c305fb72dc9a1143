"""What the pipelines need from the models, whichever process runs them."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from models.types import AnalyzedFace


class FaceAnalysisBackend(Protocol):
    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        """Faces in one RGB uint8 image with their descriptors and/or age estimates."""

"""dlib ResNet face descriptors on ONNX Runtime, batched.

Feed chips made by dlib.get_face_chip(img, shape5, size=150, padding=0.25) (uint8 RGB); the model does
dlib's normalisation itself. Descriptors are NOT L2-normalised: compare them by Euclidean distance, as dlib
does (its operating threshold is 0.6).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.convert import CHIP_SIZE, DESCRIPTOR_DIM, INPUT_NAME, OUTPUT_NAME
from models.errors import ModelFormatError
from models.sessions import SessionOptions, create_session

# Stored next to every vector so vectors from a different model are never compared with these.
MODEL_VERSION = "dlib_resnet_v1"

CHIP_SHAPE = (CHIP_SIZE, CHIP_SIZE, 3)
_WARMUP_BATCH = 2


class FaceEmbedder:
    """128-d dlib face descriptors for batches of aligned 150x150 RGB chips."""

    def __init__(self, model_path: Path, options: SessionOptions) -> None:
        warmup = {INPUT_NAME: np.zeros((_WARMUP_BATCH, *CHIP_SHAPE), dtype=np.uint8)}
        self._session = create_session(model_path, options, warmup_feed=warmup)
        inputs = [node.name for node in self._session.get_inputs()]
        outputs = [node.name for node in self._session.get_outputs()]
        if inputs != [INPUT_NAME] or outputs != [OUTPUT_NAME]:
            raise ModelFormatError(
                f"{model_path}: expected input {INPUT_NAME!r} and output {OUTPUT_NAME!r}, found "
                f"{inputs} -> {outputs}; regenerate it with `python -m models.convert`"
            )
        self.model_path = model_path

    def embed(self, chips: np.ndarray) -> np.ndarray:
        """[N,150,150,3] uint8 RGB chips -> float32 [N,128] descriptors (N may be 0)."""
        if chips.dtype != np.uint8 or chips.ndim != 4 or chips.shape[1:] != CHIP_SHAPE:
            raise ValueError(
                f"chips must be uint8 [N,{CHIP_SIZE},{CHIP_SIZE},3] RGB, got {chips.dtype} {chips.shape}"
            )
        if chips.shape[0] == 0:
            # ONNX Runtime handles empty batches inconsistently across kernels; answer it here.
            return np.zeros((0, DESCRIPTOR_DIM), dtype=np.float32)
        (descriptors,) = self._session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(chips)})
        return np.asarray(descriptors, dtype=np.float32)

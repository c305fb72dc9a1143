"""Batch settings shared by the model deployments, changeable at run time through Serve's user_config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchConfig:
    max_batch_size: int = 16
    batch_wait_timeout_s: float = 0.005
    max_faces_per_run: int = 64  # chips per ONNX run; a batch of requests is cut into runs of this many faces

    @classmethod
    def from_user_config(cls, config: dict[str, Any] | None) -> BatchConfig:
        config = config or {}
        defaults = cls()
        return cls(
            max_batch_size=int(config.get("max_batch_size", defaults.max_batch_size)),
            batch_wait_timeout_s=float(config.get("batch_wait_timeout_s", defaults.batch_wait_timeout_s)),
            max_faces_per_run=int(config.get("max_faces_per_run", defaults.max_faces_per_run)),
        )

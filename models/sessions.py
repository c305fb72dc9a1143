"""One place that creates ONNX Runtime sessions: provider choice, thread counts, optimisation, warm-up."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

logger = logging.getLogger(__name__)

DEFAULT_PROVIDER_PREFERENCE: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")


@dataclass(frozen=True)
class SessionOptions:
    """How to run a model. intra_op_threads=0 lets ONNX Runtime use every core it sees.

    allow_spinning: ONNX Runtime's intra-op threads busy-wait for the next operator by default. Between runs
    our pipelines do CPU work of their own (decoding, dlib alignment, chips), and on a small CPU box the
    spinning threads take the cores that work needs: measured on 2 cores in one bench/speed.py run (it prints
    both), turning it off raised the whole pipeline from 46 to 77 images/s and halved CPU per image.
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    provider_preference: Sequence[str] = field(default=DEFAULT_PROVIDER_PREFERENCE)
    allow_spinning: bool = False


def choose_providers(preference: Sequence[str]) -> list[str]:
    available = set(ort.get_available_providers())
    chosen = [name for name in preference if name in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def create_session(
    model: Path | bytes, options: SessionOptions, warmup_feed: dict[str, np.ndarray] | None = None
) -> ort.InferenceSession:
    """Build a session with full graph optimisation and run one warm-up inference so the first
    real request does not pay for lazy initialisation (CUDA kernels, memory arenas)."""
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session_options.intra_op_num_threads = options.intra_op_threads
    session_options.inter_op_num_threads = options.inter_op_threads
    session_options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    spinning = "1" if options.allow_spinning else "0"
    session_options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    session_options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    providers = choose_providers(options.provider_preference)
    source = str(model) if isinstance(model, Path) else model
    session = ort.InferenceSession(source, sess_options=session_options, providers=providers)
    logger.info(
        "onnx session %s on %s", model if isinstance(model, Path) else "<bytes>", session.get_providers()
    )
    if warmup_feed is not None:
        session.run(None, warmup_feed)
    return session

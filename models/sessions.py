"""One place that creates ONNX Runtime sessions: provider choice, thread counts, optimisation, warm-up."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort

from models.errors import ProviderUnavailable

logger = logging.getLogger(__name__)

DEFAULT_PROVIDER_PREFERENCE: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")


@dataclass(frozen=True)
class SessionOptions:
    """How to run a model. intra_op_threads=0 lets ONNX Runtime use every core it sees.

    allow_spinning: ONNX Runtime's intra-op threads busy-wait for the next operator by default. Between runs
    our pipelines do CPU work of their own (decoding, dlib alignment, chips), and on a small CPU box the
    spinning threads take the cores that work needs: measured on 2 cores in one run of bench/speed.py (since
    removed), turning it off raised the whole pipeline from 46 to 77 images/s and halved CPU per image.
    """

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    provider_preference: Sequence[str] = field(default=DEFAULT_PROVIDER_PREFERENCE)
    allow_spinning: bool = False
    # Full optimisation and sequential execution won in the pipeline benchmark (bench/ort_settings.py, since
    # removed, on 2 cores: the extended level and the parallel executor each cost 30-70 % more CPU per image);
    # the fields let a benchmark measure the alternatives. "parallel" needs inter_op_threads > 1.
    graph_optimization: Literal["basic", "extended", "all"] = "all"
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    # When the session cannot run on the first preferred provider: "fallback" takes the next one quietly
    # (the default preference is opportunistic), "warn" does so with a warning, "fail" raises
    # ProviderUnavailable. A config that asks for CUDA uses "fail", so it never runs on CPU unnoticed.
    if_preferred_missing: Literal["fallback", "warn", "fail"] = "fallback"
    # How the CUDA provider picks each convolution's cuDNN algorithm for a new input shape: "exhaustive"
    # times every candidate (ONNX Runtime's default), "heuristic" asks cuDNN's heuristics, "default" takes
    # cuDNN's default algorithm. Ignored on CPU.
    cuda_conv_algo_search: Literal["exhaustive", "heuristic", "default"] = "exhaustive"
    # On an accelerator, every run of the session has exactly this many rows: smaller batches are padded,
    # larger ones split. ONNX Runtime's CUDA convolutions set cuDNN up again whenever a convolution's input
    # shape differs from its last one, which costs far more than the run (bench/gpu.py: the pipeline fell
    # below the CPU's speed), and the service's batches vary with the traffic. 0: every batch runs at its
    # own size, as it always does on a CPU, where padding would only cost.
    gpu_run_size: int = 0


_OPTIMIZATION_LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_EXECUTION_MODES = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}


def choose_providers(preference: Sequence[str]) -> list[str]:
    available = set(ort.get_available_providers())
    chosen = [name for name in preference if name in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def create_session(
    model: Path | bytes, options: SessionOptions, warmup_feed: dict[str, np.ndarray] | None = None
) -> ort.InferenceSession:
    """Build a session (by default with full graph optimisation, sequential execution) and run one warm-up
    inference so the first real request does not pay for lazy initialisation (CUDA kernels, memory arenas)."""
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = _OPTIMIZATION_LEVELS[options.graph_optimization]
    session_options.intra_op_num_threads = options.intra_op_threads
    session_options.inter_op_num_threads = options.inter_op_threads
    session_options.execution_mode = _EXECUTION_MODES[options.execution_mode]
    spinning = "1" if options.allow_spinning else "0"
    session_options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    session_options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
    providers = choose_providers(options.provider_preference)
    preferred = options.provider_preference[0] if options.provider_preference else None
    if options.if_preferred_missing == "fail" and preferred not in providers:
        raise ProviderUnavailable(_missing_provider(preferred, ort.get_available_providers()))
    source = str(model) if isinstance(model, Path) else model
    session = ort.InferenceSession(
        source, sess_options=session_options, providers=_with_provider_options(providers, options)
    )
    # onnxruntime-gpu lists CUDA as available even when the CUDA libraries or the GPU are missing, and then
    # quietly builds a CPU session: what counts is what the session runs on.
    if preferred is not None and preferred not in session.get_providers():
        if options.if_preferred_missing == "fail":
            raise ProviderUnavailable(_missing_provider(preferred, session.get_providers()))
        if options.if_preferred_missing == "warn":
            logger.warning(
                "%s is not available; running on %s (allow_cpu_fallback)", preferred, session.get_providers()
            )
    logger.info(
        "onnx session %s on %s", model if isinstance(model, Path) else "<bytes>", session.get_providers()
    )
    if warmup_feed is not None:
        warm_up(session, options, warmup_feed)
    return session


def warm_up(session: ort.InferenceSession, options: SessionOptions, feed: dict[str, np.ndarray]) -> None:
    """One run at the size every run_padded run of this session will have (the feed's rows padded or cut to
    it on an accelerator, where cuDNN sets up per shape), so no request pays for that set-up."""
    run_size = fixed_run_size(session, options)
    if run_size:
        feed = {name: _rows(array, run_size) for name, array in feed.items()}
    session.run(None, feed)


def _rows(batch: np.ndarray, count: int) -> np.ndarray:
    """The first `count` rows of a batch, zero rows appended where it has fewer."""
    padding = np.zeros((max(0, count - len(batch)), *batch.shape[1:]), dtype=batch.dtype)
    return np.concatenate([batch[:count], padding])


def _with_provider_options(
    providers: Sequence[str], options: SessionOptions
) -> list[str | tuple[str, dict[str, str]]]:
    cuda = {"cudnn_conv_algo_search": options.cuda_conv_algo_search.upper()}
    return [(name, cuda) if name == "CUDAExecutionProvider" else name for name in providers]


def _missing_provider(required: str | None, offered: Sequence[str]) -> str:
    return (
        f"the model config asks for {required}, but only {list(offered)} can run here (for CUDA: "
        "onnxruntime-gpu installed, CUDA/cuDNN libraries found, a GPU visible to this process). "
        "Set model_config.allow_cpu_fallback: true to run on CPU instead."
    )


def fixed_run_size(session: ort.InferenceSession, options: SessionOptions) -> int:
    """The rows of every run_padded run of this session: 0 (any) on a CPU."""
    on_cpu = session.get_providers()[0] == "CPUExecutionProvider"
    return 0 if on_cpu else options.gpu_run_size


def run_padded(
    session: ort.InferenceSession,
    output_names: Sequence[str],
    input_name: str,
    batch: np.ndarray,
    run_size: int,
) -> list[np.ndarray]:
    """session.run on a batch along axis 0; with run_size > 0, in runs of exactly run_size rows (zero-padded,
    the padding's outputs dropped). Every output must be batched along axis 0 too."""
    if run_size <= 0 or len(batch) == 0:
        return list(session.run(list(output_names), {input_name: batch}))
    runs: list[list[np.ndarray]] = []
    for start in range(0, len(batch), run_size):
        rows = batch[start : start + run_size]
        outputs = session.run(list(output_names), {input_name: _rows(rows, run_size)})
        runs.append([output[: len(rows)] for output in outputs])
    return [np.concatenate(parts) for parts in zip(*runs, strict=True)]


class SessionRunner:
    """What every runner built on one ONNX Runtime session answers about it."""

    _session: ort.InferenceSession

    @property
    def providers(self) -> list[str]:
        """The providers this session was built with, in priority order (which nodes each runs: bench.gpu)."""
        return list(self._session.get_providers())

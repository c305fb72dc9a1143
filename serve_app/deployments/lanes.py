"""Where a replica's blocking inference runs: worker threads, a fixed number at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

_Result = TypeVar("_Result")


class InferenceLane:
    """Runs a replica's blocking inference in worker threads, at most `runs` calls at a time.

    Off the event loop, the replica keeps receiving requests while a batch computes, so the next batch is
    assembled in the meantime instead of after it (ONNX Runtime releases the GIL while it runs). Health
    checks take a place in the lane like a batch. ONNX Runtime sessions and dlib's predictor may be called
    from several threads at once, so `runs` > 1 only needs the cores: on a small CPU box two single-threaded
    runs keep both cores busy through the parts of a batch that one thread does alone (dlib's landmarks,
    the chips, NMS), which intra-op threads cannot share (docs/performance.md)."""

    def __init__(self, runs: int = 1) -> None:
        if runs < 1:
            raise ValueError(f"an inference lane needs at least one run at a time, got {runs}")
        self.runs = runs
        self._places = asyncio.Semaphore(runs)

    async def run(self, function: Callable[..., _Result], *args: Any) -> _Result:
        async with self._places:
            return await asyncio.to_thread(function, *args)

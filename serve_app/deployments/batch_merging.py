"""Batches that wait for a free lane run as one.

Serve's batch queue (ray 2.60) closes a batch once its wait times out, whether or not a lane is free to run
it; the batches it closes while every lane is busy queue up for the next free one, each with the few
requests that arrived in its own wait. Under load the runs then stay as small as at low load, and every run
pays its fixed costs again (a thread hand-off, the run's own set-up, its metrics). BatchMerger takes the
batches as Serve hands them over and, whenever a lane frees up, runs every batch waiting by then in one
call, up to `max_items` requests, and answers each batch with its own slice of the outputs. A batch that
finds a lane free runs at once, so nothing waits longer than it did.

No Ray here: the runner is any blocking function from a list of requests to a list of outputs, in order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from serve_app.deployments.lanes import InferenceLane

Item = TypeVar("Item")
Output = TypeVar("Output")


@dataclass
class _Waiting(Generic[Item, Output]):
    items: Sequence[Item]
    answer: asyncio.Future[list[Output]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class BatchMerger(Generic[Item, Output]):
    def __init__(
        self,
        lane: InferenceLane,
        run: Callable[[list[Item]], list[Output]],
        max_items: Callable[[], int],
        observe: Callable[[int, list[Output], float], None] | None = None,
    ) -> None:
        """run: the blocking runner, called in the lane's threads. max_items: the most requests one call
        takes (read at each call, so a live reconfiguration applies to the next run). observe: told each
        run's request count, outputs and seconds (metrics)."""
        self._lane = lane
        self._run = run
        self._max_items = max_items
        self._observe = observe
        self._waiting: deque[_Waiting[Item, Output]] = deque()
        self._runs: set[asyncio.Task[None]] = set()

    async def run(self, items: Sequence[Item]) -> list[Output]:
        """The outputs of `items`, in order. The batch of a caller cancelled while it waits is left out
        of the next run; one cancelled while its batch runs leaves the run to finish for the others."""
        if not items:
            return []
        waiting: _Waiting[Item, Output] = _Waiting(items)
        self._waiting.append(waiting)
        self._start_runs()
        return await waiting.answer

    def _start_runs(self) -> None:
        while len(self._runs) < self._lane.runs and self._waiting:
            taken = self._take()
            if not taken:
                return
            task = asyncio.create_task(self._execute(taken))
            self._runs.add(task)
            task.add_done_callback(self._finished)

    def _take(self) -> list[_Waiting[Item, Output]]:
        """The oldest waiting batches, up to max_items requests (the first one whatever its size)."""
        limit = max(1, self._max_items())
        taken: list[_Waiting[Item, Output]] = []
        count = 0
        while self._waiting:
            waiting = self._waiting[0]
            if waiting.answer.done():  # its caller was cancelled: nobody wants the outputs
                self._waiting.popleft()
                continue
            if taken and count + len(waiting.items) > limit:
                break
            taken.append(self._waiting.popleft())
            count += len(waiting.items)
        return taken

    async def _execute(self, taken: list[_Waiting[Item, Output]]) -> None:
        items = [item for waiting in taken for item in waiting.items]
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            outputs = await self._lane.run(self._run, items)
            if len(outputs) != len(items):
                raise RuntimeError(f"the runner returned {len(outputs)} outputs for {len(items)} requests")
        except asyncio.CancelledError:  # the replica is shutting down
            for waiting in taken:
                waiting.answer.cancel()
            raise
        except Exception as error:  # every caller of the run hears of it
            for waiting in taken:
                if not waiting.answer.done():
                    waiting.answer.set_exception(error)
            return
        start = 0
        for waiting in taken:
            end = start + len(waiting.items)
            if not waiting.answer.done():
                waiting.answer.set_result(outputs[start:end])
            start = end
        if self._observe is not None:  # after the answers: a metrics failure must not hold the callers
            self._observe(len(items), outputs, loop.time() - started)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._runs.discard(task)
        self._start_runs()

"""BatchMerger: batches that wait for a busy lane run together, each answered with its own outputs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from serve_app.deployments.batch_merging import BatchMerger
from serve_app.deployments.lanes import InferenceLane
from tests.unit.fakes import wait_until


class GatedRunner:
    """A blocking runner that records its calls; while `gate` is closed, runs wait in their threads."""

    def __init__(self, fail_on: int | None = None, drop_one: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self._fail_on = fail_on
        self._drop_one = drop_one
        self._guard = threading.Lock()
        self.running = 0
        self.most_at_once = 0

    def __call__(self, items: list[int]) -> list[int]:
        with self._guard:
            self.calls.append(list(items))
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if not self.gate.wait(timeout=30):  # the timeout only stops a broken test from hanging
                raise TimeoutError("the test never opened the gate")
            if self._fail_on is not None and self._fail_on in items:
                raise ValueError(f"cannot run {self._fail_on}")
            outputs = [item * 10 for item in items]
            return outputs[:-1] if self._drop_one else outputs
        finally:
            with self._guard:
                self.running -= 1


def scenario(
    runner: GatedRunner, runs: int, max_items: int, body: Callable[[BatchMerger[int, int]], Awaitable[object]]
) -> object:
    async def main() -> object:
        merger: BatchMerger[int, int] = BatchMerger(InferenceLane(runs), runner, lambda: max_items)
        return await body(merger)

    return asyncio.run(main())


def test_a_batch_that_finds_the_lane_free_runs_at_once_on_its_own() -> None:
    runner = GatedRunner()

    async def body(merger: BatchMerger[int, int]) -> object:
        return await merger.run([1, 2])

    assert scenario(runner, 1, 16, body) == [10, 20]
    assert runner.calls == [[1, 2]]


async def _hold_the_lane(merger: BatchMerger[int, int], runner: GatedRunner) -> asyncio.Task[list[int]]:
    """Starts a run of [0] and waits until it holds the lane's one place (its thread waits at the gate)."""
    runner.gate.clear()
    first = asyncio.create_task(merger.run([0]))
    await wait_until(lambda: len(runner.calls) == 1, timeout_s=30, what="the first run")
    return first


def test_batches_that_wait_for_a_busy_lane_run_as_one_and_each_gets_its_own_outputs() -> None:
    runner = GatedRunner()

    async def body(merger: BatchMerger[int, int]) -> object:
        first = await _hold_the_lane(merger, runner)
        waiting = [asyncio.create_task(merger.run(items)) for items in ([1, 2], [3], [4, 5])]
        await asyncio.sleep(0.01)
        assert runner.calls == [[0]]  # the waiting batches did not start runs of their own
        runner.gate.set()
        return [await first, *[await task for task in waiting]]

    assert scenario(runner, 1, 16, body) == [[0], [10, 20], [30], [40, 50]]
    assert runner.calls == [[0], [1, 2, 3, 4, 5]]


def test_a_merged_run_takes_the_oldest_batches_up_to_max_items() -> None:
    runner = GatedRunner()

    async def body(merger: BatchMerger[int, int]) -> object:
        first = await _hold_the_lane(merger, runner)
        waiting = [asyncio.create_task(merger.run(items)) for items in ([1, 2], [3], [4, 5], [6, 7, 8, 9])]
        await asyncio.sleep(0.01)
        runner.gate.set()
        return [await first, *[await task for task in waiting]]

    assert scenario(runner, 1, 3, body) == [[0], [10, 20], [30], [40, 50], [60, 70, 80, 90]]
    # A batch larger than max_items still runs, on its own.
    assert runner.calls == [[0], [1, 2, 3], [4, 5], [6, 7, 8, 9]]


def test_runs_never_exceed_the_lanes_places() -> None:
    runner = GatedRunner()

    async def body(merger: BatchMerger[int, int]) -> object:
        runner.gate.clear()
        tasks = [asyncio.create_task(merger.run([item])) for item in range(6)]
        await wait_until(lambda: len(runner.calls) == 2, timeout_s=30, what="two runs")
        await asyncio.sleep(0.01)  # a merger that started a third run would have done so by now
        runner.gate.set()
        return [await task for task in tasks]

    assert scenario(runner, 2, 16, body) == [[0], [10], [20], [30], [40], [50]]
    assert runner.most_at_once == 2
    assert runner.calls == [[0], [1], [2, 3, 4, 5]]


def test_a_failed_run_fails_every_batch_in_it_and_the_next_run_goes_ahead() -> None:
    runner = GatedRunner(fail_on=3)

    async def body(merger: BatchMerger[int, int]) -> object:
        first = await _hold_the_lane(merger, runner)
        merged = [asyncio.create_task(merger.run(items)) for items in ([1, 2], [3])]
        await asyncio.sleep(0.01)
        runner.gate.set()
        outcomes = await asyncio.gather(first, *merged, return_exceptions=True)
        later = await merger.run([4])
        return outcomes, later

    result = scenario(runner, 1, 16, body)
    assert isinstance(result, tuple)
    outcomes, later = result
    assert outcomes[0] == [0]
    assert [str(outcome) for outcome in outcomes[1:]] == ["cannot run 3", "cannot run 3"]
    assert later == [40]


def test_a_runner_that_loses_an_output_is_an_error_not_a_shifted_answer() -> None:
    runner = GatedRunner(drop_one=True)

    async def body(merger: BatchMerger[int, int]) -> object:
        return await merger.run([1, 2])

    with pytest.raises(RuntimeError, match="1 outputs for 2 requests"):
        scenario(runner, 1, 16, body)


def test_a_batch_whose_caller_gave_up_while_it_waited_is_not_run() -> None:
    runner = GatedRunner()

    async def body(merger: BatchMerger[int, int]) -> object:
        first = await _hold_the_lane(merger, runner)
        abandoned = asyncio.create_task(merger.run([1]))
        kept = asyncio.create_task(merger.run([2]))
        await asyncio.sleep(0.01)
        abandoned.cancel()
        await asyncio.sleep(0.01)
        runner.gate.set()
        return await first, await kept, abandoned.cancelled()

    assert scenario(runner, 1, 16, body) == ([0], [20], True)
    assert runner.calls == [[0], [2]]

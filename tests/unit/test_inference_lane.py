"""InferenceLane: blocking inference runs off the replica's event loop, at most `runs` calls at a time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serve_app.deployments.lanes import InferenceLane


@pytest.mark.parametrize("runs", [1, 2])
def test_calls_run_at_most_runs_at_a_time_while_the_event_loop_stays_free(runs: int) -> None:
    running = 0
    most_at_once = 0
    entered = 0
    guard = threading.Lock()
    released_by_the_loop = threading.Event()

    def blocking_inference(seconds: float) -> tuple[str, bool]:
        nonlocal running, most_at_once, entered
        with guard:
            running += 1
            entered += 1
            most_at_once = max(most_at_once, running)
        # Holds its thread until the event loop releases it: only a loop that is free while inference
        # blocks can. The timeout only stops a broken lane from hanging the test.
        released = released_by_the_loop.wait(timeout=30)
        time.sleep(seconds)  # stands in for a model run that holds its thread
        with guard:
            running -= 1
        return threading.current_thread().name, released

    async def scenario() -> list[tuple[str, bool]]:
        lane = InferenceLane(runs)
        calls = asyncio.gather(*(lane.run(blocking_inference, 0.05) for _ in range(4)))
        # Every place of the lane taken (a lane that gives fewer places is caught by the count below once the
        # deadline passes; one that gives more, by most_at_once). The loop polls, so it stays free meanwhile.
        deadline = time.monotonic() + 30
        while entered < runs and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # a lane with one place too many would let another call in now
        released_by_the_loop.set()  # the loop runs this while the first calls hold the lane
        return list(await calls)

    results = asyncio.run(scenario())
    assert most_at_once == runs
    assert threading.main_thread().name not in {name for name, _ in results}
    assert all(released for _, released in results)

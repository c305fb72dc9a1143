"""InferenceLane: blocking inference runs off the replica's event loop, one call at a time."""

from __future__ import annotations

import asyncio
import threading
import time

from serve_app.deployments.models import InferenceLane


def test_calls_run_one_at_a_time_while_the_event_loop_stays_free() -> None:
    running = 0
    most_at_once = 0
    guard = threading.Lock()
    entered = threading.Event()
    released_by_the_loop = threading.Event()

    def blocking_inference(seconds: float) -> tuple[str, bool]:
        nonlocal running, most_at_once
        with guard:
            running += 1
            most_at_once = max(most_at_once, running)
        entered.set()
        # Holds its thread until the event loop releases it: only a loop that is free while inference
        # blocks can. The timeout only stops a broken lane from hanging the test.
        released = released_by_the_loop.wait(timeout=30)
        time.sleep(seconds)  # stands in for a model run that holds its thread
        with guard:
            running -= 1
        return threading.current_thread().name, released

    async def scenario() -> list[tuple[str, bool]]:
        lane = InferenceLane()
        calls = asyncio.gather(*(lane.run(blocking_inference, 0.05) for _ in range(3)))
        # A threading.Event, set from the inference thread: the loop polls it so that it stays free meanwhile.
        while not entered.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        released_by_the_loop.set()  # the loop runs this while the first call holds the lane
        return list(await calls)

    results = asyncio.run(scenario())
    assert most_at_once == 1
    assert threading.main_thread().name not in {name for name, _ in results}
    assert all(released for _, released in results)

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

    def blocking_inference(seconds: float) -> str:
        nonlocal running, most_at_once
        with guard:
            running += 1
            most_at_once = max(most_at_once, running)
        time.sleep(seconds)  # stands in for a model run that holds its thread
        with guard:
            running -= 1
        return threading.current_thread().name

    async def scenario() -> tuple[list[str], int]:
        lane = InferenceLane()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        threads = await asyncio.gather(*(lane.run(blocking_inference, 0.1) for _ in range(3)))
        ticking.cancel()
        return list(threads), ticks

    threads, ticks = asyncio.run(scenario())
    assert most_at_once == 1
    assert threading.main_thread().name not in threads
    # Three 0.1 s runs in sequence: a free loop ticks about 30 times meanwhile; a blocked one would not tick.
    assert ticks >= 15

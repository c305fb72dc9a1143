"""QueueWorker over the fake consumer-group queue: claim, process, ack, reclaim, poison entries, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import pytest

from serve_app.domain.errors import BackendRejected
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.pipelines.commands import FaceSearchCommand
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from tests.unit.fakes import Color, ManualClock, World, embedding, face, solid_png, wait_until

TENANT = "tenant-a"
RED: Color = (200, 30, 30)

FAST = WorkerPolicy(
    concurrency=4,
    stale_after_s=30.0,
    max_deliveries=3,
    claim_block_ms=5,
    reclaim_every_s=0.01,
    backoff_s=0.01,
)


def new_world() -> World:
    world = World(queue_clock=ManualClock())
    world.analysis.faces_by_color[RED] = [face(embedding(1))]
    return world


def make_worker(world: World, policy: WorkerPolicy = FAST, consumer: str = "worker-1") -> QueueWorker:
    return QueueWorker(consumer, world.queue, world.processor(), policy)


async def submit(world: World, color: Color = RED) -> Transaction:
    command = FaceSearchCommand(TENANT, solid_png(color), None, allow_override=False, enroll_face=True)
    return await world.transaction_service().create_face_search(command)


@contextlib.asynccontextmanager
async def running(worker: QueueWorker) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


def attempt_done(world: World, worker: QueueWorker, attempts: int) -> Callable[[], bool]:
    """True once analysis ran `attempts` times and nothing is in flight any more."""
    return lambda: len(world.analysis.calls) == attempts and worker.in_flight == 0


def delivery_done(world: World, worker: QueueWorker, deliveries: int) -> Callable[[], bool]:
    """True once the queue handed out `deliveries` entries and nothing is in flight any more."""
    return lambda: len(world.queue.deliveries) == deliveries and worker.in_flight == 0


def state(world: World, tx: Transaction) -> TransactionState:
    return world.transactions.peek(tx.reference_id).state


def test_processes_and_acknowledges_every_entry() -> None:
    async def scenario() -> None:
        world = new_world()
        transactions = [await submit(world) for _ in range(6)]
        worker = make_worker(world)
        async with running(worker):
            await wait_until(lambda: len(world.queue.acked) == 6, what="six acknowledgements")
        assert all(state(world, tx) is TransactionState.COMPLETED for tx in transactions)
        assert sorted(world.queue.acked) == sorted(world.transactions.entry_of.values())
        assert await world.queue.depth() == 0
        assert worker.processed == 6
        assert worker.in_flight == 0

    asyncio.run(scenario())


def test_never_runs_more_than_concurrency_transactions_at_once() -> None:
    async def scenario() -> None:
        world = new_world()
        world.analysis.gate = asyncio.Event()
        transactions = [await submit(world) for _ in range(5)]
        worker = make_worker(world, WorkerPolicy(**{**FAST.__dict__, "concurrency": 2}))
        async with running(worker):
            await wait_until(lambda: world.analysis.started == 2, what="two transactions in analysis")
            await asyncio.sleep(0.05)
            assert world.analysis.started == 2
            assert worker.in_flight == 2
            assert world.queue.undelivered == 3
            world.analysis.gate.set()
            await wait_until(lambda: len(world.queue.acked) == 5, what="all acknowledged")
        assert all(state(world, tx) is TransactionState.COMPLETED for tx in transactions)

    asyncio.run(scenario())


def test_a_saturated_worker_never_asks_the_queue_for_zero_entries(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        world = new_world()
        world.analysis.gate = asyncio.Event()
        transactions = [await submit(world) for _ in range(3)]
        worker = make_worker(world, WorkerPolicy(**{**FAST.__dict__, "concurrency": 2, "backoff_s": 0.5}))
        async with running(worker):
            await wait_until(lambda: world.analysis.started == 2, what="the worker to fill up")
            await asyncio.sleep(0.1)  # ten reclaim periods while every slot is taken
            world.analysis.gate.set()
            await wait_until(lambda: len(world.queue.acked) == 3, what="all three acknowledged")
        assert all(state(world, tx) is TransactionState.COMPLETED for tx in transactions)
        assert world.faults.calls.get("queue.reclaim_stale", 0) >= 1

    with caplog.at_level(logging.WARNING, logger="serve_app.pipelines.worker"):
        asyncio.run(scenario())
    # A request for zero entries would have been refused (BackendUnavailable, logged, then a backoff).
    assert "COUNT must be > 0" not in caplog.text


def test_a_failed_attempt_stays_pending_until_reclaimed_then_completes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        world = new_world()
        assert isinstance(world.queue_clock, ManualClock)
        world.analysis.failures.append(RuntimeError("model replica died"))
        tx = await submit(world)
        entry_id = world.transactions.entry_of[tx.reference_id]
        worker = make_worker(world)
        async with running(worker):
            await wait_until(
                lambda: len(world.analysis.calls) == 1 and worker.in_flight == 0, what="attempt 1"
            )
            await asyncio.sleep(0.05)  # several reclaim rounds, but the entry is not idle long enough yet
            assert world.queue.acked == []
            assert world.queue.pending == {entry_id: 1}
            assert state(world, tx) is TransactionState.PROCESSING
            assert len(world.analysis.calls) == 1

            world.queue_clock.advance(FAST.stale_after_s)
            await wait_until(lambda: world.queue.acked == [entry_id], what="the retried entry acknowledged")
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.COMPLETED
        assert final.attempts == 2
        assert [entry.deliveries for entry in world.queue.deliveries] == [1, 2]
        assert world.queue.pending == {}
        assert worker.processed == 1

    with caplog.at_level(logging.ERROR, logger="serve_app.pipelines.worker"):
        asyncio.run(scenario())
    assert "will retry" in caplog.text


def test_an_entry_delivered_more_than_max_deliveries_fails_its_transaction_and_is_acked() -> None:
    async def scenario() -> None:
        world = new_world()
        assert isinstance(world.queue_clock, ManualClock)
        world.analysis.failures.extend(RuntimeError(f"boom {n}") for n in range(10))
        tx = await submit(world)
        entry_id = world.transactions.entry_of[tx.reference_id]
        worker = make_worker(world)
        async with running(worker):
            for attempt in range(1, FAST.max_deliveries + 1):
                await wait_until(attempt_done(world, worker, attempt), what=f"attempt {attempt}")
                world.queue_clock.advance(FAST.stale_after_s)
            await wait_until(lambda: world.queue.acked == [entry_id], what="the poison entry acknowledged")
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED
        assert final.error == "The transaction could not be processed."
        assert len(world.analysis.calls) == FAST.max_deliveries  # not processed a fourth time
        assert [entry.deliveries for entry in world.queue.deliveries] == [1, 2, 3, 4]
        assert await world.queue.depth() == 0

    asyncio.run(scenario())


def test_a_poison_entry_never_overwrites_a_transaction_that_already_completed() -> None:
    async def scenario() -> None:
        world = new_world()
        assert isinstance(world.queue_clock, ManualClock)
        tx = await submit(world)
        entry_id = world.transactions.entry_of[tx.reference_id]
        world.faults.arm("queue.ack", times=FAST.max_deliveries)  # completes, but every ack is lost
        worker = make_worker(world)
        async with running(worker):
            for delivery in range(1, FAST.max_deliveries + 1):
                await wait_until(delivery_done(world, worker, delivery), what=f"delivery {delivery}")
                world.queue_clock.advance(FAST.stale_after_s)
            await wait_until(lambda: world.queue.acked == [entry_id], what="acknowledged at last")
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.COMPLETED
        assert final.error is None
        assert len(world.analysis.calls) == 1  # redeliveries of a final transaction do no work
        # The give-up found it completed: its face stays enrolled.
        assert world.gallery.face_ids(TENANT) == {enrolled_face_id(tx.reference_id)}

    asyncio.run(scenario())


def test_backend_unavailable_from_claim_is_retried_after_the_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sleep = asyncio.sleep
    slept: list[float] = []

    async def recording_sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(delay)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)

    async def scenario() -> None:
        world = new_world()
        world.faults.arm("queue.claim", times=3)
        world.faults.arm("queue.reclaim_stale", times=1)
        tx = await submit(world)
        policy = WorkerPolicy(**{**FAST.__dict__, "backoff_s": 0.05})
        worker = make_worker(world, policy)
        async with running(worker):
            await wait_until(lambda: state(world, tx) is TransactionState.COMPLETED, what="completion")
            await wait_until(lambda: len(world.queue.acked) == 1, what="acknowledgement")
        # Four outages, each followed by one backoff before the next try.
        assert slept.count(policy.backoff_s) >= 4
        assert world.faults.calls["queue.claim"] >= 4

    asyncio.run(scenario())


def test_run_stops_when_asked_and_drains_work_in_flight() -> None:
    async def scenario() -> None:
        world = new_world()
        world.analysis.gate = asyncio.Event()
        first = await submit(world)
        worker = make_worker(world)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await wait_until(lambda: world.analysis.started == 1, what="first transaction in analysis")

        stop.set()
        await asyncio.sleep(0.05)  # lets a claim that was already blocking when stop was set return
        late = await submit(world)  # arrives after the stop request: must not be claimed
        done, _ = await asyncio.wait({task}, timeout=0.1)
        assert not done, "run() returned while a transaction was still in flight"
        assert worker.in_flight == 1

        world.analysis.gate.set()
        await asyncio.wait_for(task, 5)
        assert state(world, first) is TransactionState.COMPLETED
        assert world.queue.acked == [world.transactions.entry_of[first.reference_id]]
        assert state(world, late) is TransactionState.QUEUED
        assert world.queue.undelivered == 1
        assert worker.in_flight == 0

    asyncio.run(scenario())


def test_a_processing_error_is_logged_and_the_worker_keeps_going(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        world = new_world()
        world.faults.arm("gallery.search", error=RuntimeError("a bug"))  # not an outage: stays pending
        bad = await submit(world)
        good = await submit(world)
        # One at a time, so the armed fault hits `bad` (claimed first) whatever the scheduling order;
        # with both in flight either could reach the gallery first.
        worker = make_worker(world, dataclasses.replace(FAST, concurrency=1))
        async with running(worker):
            await wait_until(lambda: state(world, good) is TransactionState.COMPLETED, what="second done")
        assert state(world, bad) is TransactionState.PROCESSING
        assert world.transactions.entry_of[bad.reference_id] in world.queue.pending

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert "failed; will retry" in caplog.text


def test_a_backend_outage_requeues_with_a_fresh_delivery_count_and_never_fails() -> None:
    """Outages are not the transaction's fault: however many attempts hit one, it is requeued as a new,
    never-delivered entry and completes once the backend is back."""

    async def scenario() -> None:
        world = new_world()
        outages = 3 * make_worker(world)._policy.max_deliveries
        world.faults.arm("gallery.search", times=outages)
        tx = await submit(world)
        worker = make_worker(world)
        worker.update_policy(dataclasses.replace(worker._policy, outage_backoff_s=0.001))
        async with running(worker):
            await wait_until(lambda: state(world, tx) is TransactionState.COMPLETED, what="completed")
        assert world.queue.requeued.count(tx.reference_id) == outages
        assert all(entry.deliveries == 1 for entry in world.queue.deliveries)

    asyncio.run(scenario())


def test_a_backend_rejecting_a_transaction_counts_as_failed_attempts_and_ends_failed() -> None:
    """A request a backend refuses every time (not an outage) must end `failed`, not be requeued forever."""

    async def scenario() -> None:
        world = new_world()
        assert isinstance(world.queue_clock, ManualClock)
        world.faults.arm("gallery.search", times=100, error=BackendRejected("Milvus refused the request"))
        tx = await submit(world)
        entry_id = world.transactions.entry_of[tx.reference_id]
        worker = make_worker(world)
        async with running(worker):
            for attempt in range(1, FAST.max_deliveries + 1):
                await wait_until(attempt_done(world, worker, attempt), what=f"attempt {attempt}")
                world.queue_clock.advance(FAST.stale_after_s)
            await wait_until(lambda: world.queue.acked == [entry_id], what="the entry acknowledged")
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED
        assert world.queue.requeued == []
        assert len(world.analysis.calls) == FAST.max_deliveries

    asyncio.run(scenario())


def test_a_poison_entry_whose_first_attempt_enrolled_ends_failed_with_nothing_enrolled() -> None:
    """The first attempt enrols and dies before completing; the next ones fail; the give-up is itself
    interrupted once. The transaction ends failed, the entry acknowledged, and no face of it stays."""

    async def scenario() -> None:
        world = new_world()
        assert isinstance(world.queue_clock, ManualClock)
        world.faults.arm("transactions.complete", error=RuntimeError("worker killed"))
        world.faults.arm("records.delete")  # the first give-up dies half-way
        tx = await submit(world)
        entry_id = world.transactions.entry_of[tx.reference_id]
        worker = make_worker(world)
        async with running(worker):
            for attempt in range(1, FAST.max_deliveries + 1):
                await wait_until(attempt_done(world, worker, attempt), what=f"attempt {attempt}")
                if attempt == 1:
                    assert world.gallery.face_ids(TENANT) == {enrolled_face_id(tx.reference_id)}
                    world.analysis.failures.extend(RuntimeError("boom") for _ in range(FAST.max_deliveries))
                world.queue_clock.advance(FAST.stale_after_s)
            await wait_until(
                lambda: world.faults.calls.get("records.delete", 0) == 1 and worker.in_flight == 0,
                what="the first give-up",
            )
            assert world.queue.acked == []  # interrupted: not acknowledged, so delivered again
            world.queue_clock.advance(FAST.stale_after_s)
            await wait_until(lambda: world.queue.acked == [entry_id], what="the entry acknowledged")
        final = world.transactions.peek(tx.reference_id)
        assert final.state is TransactionState.FAILED
        assert world.gallery.face_ids() == set()
        assert world.record_store.records() == []
        assert tx.image_key not in world.blobs.items

    asyncio.run(scenario())


def test_a_dead_consumer_is_forgotten_once_its_entry_was_reclaimed_and_it_stayed_idle() -> None:
    async def scenario() -> None:
        world = new_world()
        clock = world.queue_clock
        assert isinstance(clock, ManualClock)
        tx = await submit(world)
        assert len(await world.queue.claim("replica-before-restart", 1, 0)) == 1  # ... and it dies
        # The stale and gone windows pass on the queue's manual clock; the worker prunes every 20 ms.
        policy = dataclasses.replace(FAST, stale_after_s=0.05, gone_after_stale_windows=2)
        worker = make_worker(world, policy, consumer="replica-after-restart")
        async with running(worker):
            await wait_until(
                lambda: "replica-after-restart" in world.queue.consumers, what="the worker in the group"
            )
            clock.advance(policy.stale_after_s)
            await wait_until(lambda: state(world, tx) is TransactionState.COMPLETED, what="reclaimed, done")
            await asyncio.sleep(0.05)  # several prune rounds: idle for one stale window is not gone
            assert "replica-before-restart" in world.queue.consumers
            clock.advance(policy.consumer_gone_after_s)
            await wait_until(
                lambda: set(world.queue.consumers) == {"replica-after-restart"}, what="the dead one removed"
            )
        assert worker.processed == 1

    asyncio.run(scenario())

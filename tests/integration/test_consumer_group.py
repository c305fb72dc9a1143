"""Worker identity on a real redis-server: every worker replica is one consumer of the queue's group, and a
worker that is gone (killed, restarted under a new name, scaled away) must not stay in the group forever.
Its pending entries are reclaimed and finished by a live worker first, then its name is removed; a live
worker, however long it works on one entry, is never removed.

Real Redis transaction store and QueueWorkers; the analysis backend is the unit tests' scripted one and the
records, gallery and blobs are the unit-test fakes (the point here is the queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import numpy as np
import pytest
from redis.asyncio import Redis

from models.types import AnalyzedFace
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.analysis import FaceAnalysisBackend
from serve_app.pipelines.commands import FaceSearchCommand
from serve_app.pipelines.processing import TransactionProcessor
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.stores.redis_support import connect_redis, text
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.unit.fakes import (
    TEST_POLICY,
    FakeBlobStore,
    FakeFaceRecordStore,
    FakeGalleryStore,
    ScriptedAnalysis,
    embedding,
    face,
    solid_png,
    wait_until,
)

TENANT = "tenant-a"
RED = (200, 30, 30)
POLICY = WorkerPolicy(
    concurrency=2,
    stale_after_s=0.2,
    max_deliveries=5,
    claim_block_ms=50,
    reclaim_every_s=0.05,
    backoff_s=0.05,
    gone_after_stale_windows=10,  # silent for 2 s: gone; each worker prunes (its heartbeat) every 0.4 s
)
HANG_GUARD_S = 60.0  # every wait below is a poll that ends far sooner; this only stops a hang


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("consumer-group") / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


class HangingAnalysis(ScriptedAnalysis):
    """A model call that never returns, on a worker about to be killed; remembers the calls' tasks so the
    kill can end them (a killed process runs nothing further)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()  # never set
        self.tasks: list[asyncio.Task[object]] = []

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        return await super().analyze(image, embed=embed, estimate_age=estimate_age)


def claimed_one(analysis: HangingAnalysis) -> bool:
    return len(analysis.tasks) == 1


class SlowAnalysis(ScriptedAnalysis):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        await asyncio.sleep(self.delay_s)  # the event loop stays free: the worker renews its lease
        return await super().analyze(image, embed=embed, estimate_age=estimate_age)


@dataclasses.dataclass
class Queue:
    redis: Redis
    store: RedisTransactionStore
    stream: str
    blobs: FakeBlobStore = dataclasses.field(default_factory=FakeBlobStore)

    def worker(self, consumer: str, analysis: ScriptedAnalysis, policy: WorkerPolicy = POLICY) -> QueueWorker:
        analysis.faces_by_color[RED] = [face(embedding(1))]
        backend: FaceAnalysisBackend = analysis
        processor = TransactionProcessor(
            self.store, FakeFaceRecordStore(), FakeGalleryStore(), self.blobs, backend, TEST_POLICY
        )
        return QueueWorker(consumer, self.store, processor, policy)

    async def submit(self) -> Transaction:
        service = TransactionService(self.store, self.blobs, 40_000_000)
        command = FaceSearchCommand(TENANT, solid_png(RED), None, allow_override=False, enroll_face=False)
        return await service.create_face_search(command)

    async def consumers(self) -> dict[str, int]:
        """The group's consumers, as Redis lists them: name -> pending entries."""
        rows = await self.redis.xinfo_consumers(self.stream, "workers")
        return {text(row["name"]): int(row["pending"]) for row in rows}

    async def all_completed(self, transactions: list[Transaction]) -> bool:
        states = [await self.store.get(tx.reference_id) for tx in transactions]
        return all(tx is not None and tx.state is TransactionState.COMPLETED for tx in states)


@contextlib.asynccontextmanager
async def queue(redis_url: str) -> AsyncIterator[Queue]:
    redis = connect_redis(redis_url)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    try:
        yield Queue(redis, RedisTransactionStore(redis, prefix=prefix), f"{prefix}sys:tx-queue")
    finally:
        await redis.aclose()


@contextlib.asynccontextmanager
async def running(*workers: QueueWorker) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run(stop)) for worker in workers]
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)


async def poll(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Await check() until it is True (a hang guard, not a speed bound)."""
    for _ in range(int(HANG_GUARD_S / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_restarted_workers_leave_the_consumer_group_bounded(redis_url: str) -> None:
    """A worker replica that keeps being killed and restarted: each start is a new consumer (a new Serve
    replica id) that claims an entry and dies holding it. The replica that finally stays up finishes every
    entry, and the group ends up holding it alone."""

    async def scenario() -> None:
        async with queue(redis_url) as q:
            restarts = 12
            # One entry each, and no reclaiming of its predecessors' before it dies.
            doomed_policy = dataclasses.replace(POLICY, concurrency=1, stale_after_s=600.0)
            transactions = []
            for generation in range(restarts):
                transactions.append(await q.submit())
                analysis = HangingAnalysis()
                doomed = q.worker(f"TransactionWorker#gen{generation}", analysis, doomed_policy)
                loop_task = asyncio.create_task(doomed.run(asyncio.Event()))
                await wait_until(functools.partial(claimed_one, analysis), HANG_GUARD_S, "the entry claimed")
                for task in (loop_task, *analysis.tasks):  # killed: nothing of it runs any more
                    task.cancel()
                await asyncio.gather(loop_task, *analysis.tasks, return_exceptions=True)
            dead = await q.consumers()
            assert len(dead) == restarts and set(dead.values()) == {1}  # each holds the entry it died with

            survivor = q.worker("TransactionWorker#survivor", ScriptedAnalysis())

            async def only_the_survivor_left() -> bool:
                return await q.consumers() == {"TransactionWorker#survivor": 0}

            async with running(survivor):
                await poll(lambda: q.all_completed(transactions), "every entry finished")
                await poll(only_the_survivor_left, "the dead consumers removed")
            assert survivor.processed == restarts
            assert await q.store.depth() == 0

    asyncio.run(scenario())


def test_a_dead_consumers_entry_is_reclaimed_and_finished_then_the_consumer_is_removed(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        async with queue(redis_url) as q:
            tx = await q.submit()
            [entry] = await q.store.claim("TransactionWorker#dead", 1, 100)  # ... and its replica dies
            assert entry.reference_id == tx.reference_id
            await asyncio.sleep(0.05)
            # However long it has been idle, a consumer holding an entry is kept: removing it would drop
            # the entry with it, never to be delivered again.
            assert await q.store.prune_consumers("TransactionWorker#live", gone_after_ms=1) == []
            assert await q.consumers() == {"TransactionWorker#dead": 1, "TransactionWorker#live": 0}

            live = q.worker("TransactionWorker#live", ScriptedAnalysis())

            async def dead_gone() -> bool:
                return "TransactionWorker#dead" not in await q.consumers()

            async with running(live):
                await poll(dead_gone, "the dead consumer removed")
            final = await q.store.get(tx.reference_id)
            assert final is not None and final.state is TransactionState.COMPLETED
            assert live.processed == 1 and await q.store.depth() == 0
            assert await q.consumers() == {"TransactionWorker#live": 0}

    asyncio.run(scenario())


def test_a_live_consumer_is_never_removed_however_long_it_works_on_one_entry(redis_url: str) -> None:
    """One worker works on a single entry for many gone-windows (saturated: it reads nothing meanwhile,
    it only renews its lease); another sits idle, polling an empty queue; a third prunes all along."""

    async def scenario() -> None:
        async with queue(redis_url) as q:
            tx = await q.submit()
            gone_after_ms = int(POLICY.consumer_gone_after_s * 1000)
            busy = q.worker(
                "TransactionWorker#busy",
                SlowAnalysis(4 * POLICY.consumer_gone_after_s),
                dataclasses.replace(POLICY, concurrency=1),
            )
            everyone = {"TransactionWorker#busy", "TransactionWorker#idle", "TransactionWorker#pruner"}
            idle = q.worker("TransactionWorker#idle", ScriptedAnalysis())
            pruner = q.worker("TransactionWorker#pruner", ScriptedAnalysis())
            samples = 0
            async with running(busy):
                await wait_until(lambda: busy.in_flight == 1, HANG_GUARD_S, "busy working")
                async with running(idle, pruner):

                    async def all_present() -> bool:
                        return set(await q.consumers()) == everyone

                    await poll(all_present, "every worker in the group")
                    while busy.processed == 0:
                        # Pruning with the workers' own window, as often as possible, removes no one.
                        assert await q.store.prune_consumers("TransactionWorker#pruner", gone_after_ms) == []
                        assert set(await q.consumers()) == everyone
                        samples += 1
                        await asyncio.sleep(0.05)
            assert samples > 10  # the checks ran throughout the slow call
            final = await q.store.get(tx.reference_id)
            assert final is not None and final.state is TransactionState.COMPLETED
            assert final.attempts == 1  # not reclaimed from the live worker either
            assert (busy.processed, idle.processed, pruner.processed) == (1, 0, 0)

    asyncio.run(scenario())

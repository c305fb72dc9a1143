"""Leases on queue entries: the real Redis transaction store and queue, two QueueWorkers on it, and a
deliberately slow scripted analysis backend (records, gallery and blobs are the unit-test fakes: the
point here is the queue).

A model call longer than the stale window must not get its transaction reclaimed and processed again by
the other worker while the first is still working on it; a hung call must end within its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from models.types import AnalyzedFace
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.analysis import DeadlineAnalysis
from serve_app.pipelines.commands import FaceSearchCommand
from serve_app.pipelines.processing import TransactionProcessor
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.stores.redis_support import connect_redis
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
STALE_AFTER_S = 0.6
SLOW_CALL_S = 2.0  # more than three stale windows

POLICY = WorkerPolicy(
    concurrency=4,
    stale_after_s=STALE_AFTER_S,
    max_deliveries=3,
    claim_block_ms=50,
    reclaim_every_s=0.05,
    backoff_s=0.05,
)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("leases") / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


class SlowAnalysis(ScriptedAnalysis):
    """Every call takes `delay_s` (asyncio.sleep: the worker's event loop stays free to renew leases)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        await asyncio.sleep(self.delay_s)
        return await super().analyze(image, embed=embed, estimate_age=estimate_age)


@contextlib.asynccontextmanager
async def workers(*running: QueueWorker) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run(stop)) for worker in running]
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


def test_a_model_call_longer_than_the_stale_window_is_processed_exactly_once(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store = RedisTransactionStore(redis, prefix=f"t{uuid.uuid4().hex[:8]}:")
        analysis = SlowAnalysis(SLOW_CALL_S)
        red = (200, 30, 30)
        analysis.faces_by_color[red] = [face(embedding(1))]
        blobs = FakeBlobStore()
        processor = TransactionProcessor(
            store, FakeFaceRecordStore(), FakeGalleryStore(), blobs, analysis, TEST_POLICY
        )
        service = TransactionService(store, blobs, 40_000_000)
        try:
            transactions: list[Transaction] = [
                await service.create_face_search(
                    FaceSearchCommand(TENANT, solid_png(red), None, allow_override=False, enroll_face=False)
                )
                for _ in range(3)
            ]
            first = QueueWorker("worker-a", store, processor, POLICY)
            second = QueueWorker("worker-b", store, processor, POLICY)  # would reclaim without leases
            async with workers(first, second):
                await wait_until(
                    lambda: first.processed + second.processed == 3,
                    timeout_s=30,
                    what="three transactions processed",
                )
                # Several more stale windows for a late duplicate to show up.
                await asyncio.sleep(2 * STALE_AFTER_S)
            finals = [await store.get(tx.reference_id) for tx in transactions]
            assert [tx.state if tx else None for tx in finals] == [TransactionState.COMPLETED] * 3
            # mark_processing counts every start of processing: exactly one each.
            assert [tx.attempts if tx else None for tx in finals] == [1, 1, 1]
            assert len(analysis.calls) == 3
            assert first.processed + second.processed == 3
            assert await store.depth() == 0
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_renewing_restarts_idle_time_without_counting_a_delivery_and_never_steals(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        p = f"t{uuid.uuid4().hex[:8]}:"
        store = RedisTransactionStore(redis, prefix=p)
        blobs = FakeBlobStore()
        service = TransactionService(store, blobs, 40_000_000)
        try:
            for _ in range(2):
                await service.create_face_search(
                    FaceSearchCommand(
                        TENANT, solid_png((1, 2, 3)), None, allow_override=False, enroll_face=False
                    )
                )
            mine, theirs = await store.claim("a", count=2, block_ms=100)
            await asyncio.sleep(0.3)
            # `theirs` goes stale and is reclaimed by b; `mine` keeps its lease.
            assert await store.renew("a", [mine.entry_id]) == [mine.entry_id]
            [reclaimed] = await store.reclaim_stale("b", min_idle_ms=250, count=10)
            assert reclaimed.entry_id == theirs.entry_id and reclaimed.deliveries == 2
            # a lost `theirs`: renewing it does not take it back from b.
            assert await store.renew("a", [mine.entry_id, theirs.entry_id]) == [mine.entry_id]
            pending = await redis.xpending_range(f"{p}sys:tx-queue", "workers", min="-", max="+", count=10)
            by_id = {row["message_id"]: (row["consumer"], row["times_delivered"]) for row in pending}
            assert by_id == {mine.entry_id: ("a", 1), theirs.entry_id: ("b", 2)}
        finally:
            await redis.aclose()

    asyncio.run(scenario())


class HungAnalysis(ScriptedAnalysis):
    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        self.started += 1
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")


def test_a_hung_model_call_times_out_frees_its_slot_and_the_transaction_ends_failed(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store = RedisTransactionStore(redis, prefix=f"t{uuid.uuid4().hex[:8]}:")
        analysis = HungAnalysis()
        blobs = FakeBlobStore()
        processor = TransactionProcessor(
            store,
            FakeFaceRecordStore(),
            FakeGalleryStore(),
            blobs,
            DeadlineAnalysis(analysis, timeout_s=0.1),
            TEST_POLICY,
        )
        service = TransactionService(store, blobs, 40_000_000)
        try:
            tx = await service.create_face_search(
                FaceSearchCommand(TENANT, solid_png((9, 9, 9)), None, allow_override=False, enroll_face=False)
            )
            worker = QueueWorker("worker-a", store, processor, POLICY)

            async def final() -> bool:
                current = await store.get(tx.reference_id)
                return current is not None and current.state.is_final

            async with workers(worker):
                for _ in range(600):
                    if await final():
                        break
                    await asyncio.sleep(0.05)
            latest = await store.get(tx.reference_id)
            assert latest is not None and latest.state is TransactionState.FAILED
            assert analysis.started == POLICY.max_deliveries  # each attempt ended, then it was given up
            assert worker.in_flight == 0
            assert await store.depth() == 0
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_stopping_worker_keeps_its_leases_while_it_drains(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store = RedisTransactionStore(redis, prefix=f"t{uuid.uuid4().hex[:8]}:")
        analysis = SlowAnalysis(SLOW_CALL_S)
        blobs = FakeBlobStore()
        processor = TransactionProcessor(
            store, FakeFaceRecordStore(), FakeGalleryStore(), blobs, analysis, TEST_POLICY
        )
        service = TransactionService(store, blobs, 40_000_000)
        try:
            tx = await service.create_face_search(
                FaceSearchCommand(TENANT, solid_png((5, 5, 5)), None, allow_override=False, enroll_face=False)
            )
            leaving = QueueWorker("worker-a", store, processor, POLICY)
            stop_leaving = asyncio.Event()
            leaving_task = asyncio.create_task(leaving.run(stop_leaving))
            await wait_until(lambda: leaving.in_flight == 1, what="worker-a busy")
            stop_leaving.set()  # shutting down: it drains its slow transaction
            staying = QueueWorker("worker-b", store, processor, POLICY)
            async with workers(staying):
                await asyncio.wait_for(leaving_task, 30)
                await asyncio.sleep(2 * STALE_AFTER_S)
            final = await store.get(tx.reference_id)
            assert final is not None and final.state is TransactionState.COMPLETED
            assert final.attempts == 1
            assert (leaving.processed, staying.processed) == (1, 0)
        finally:
            await redis.aclose()

    asyncio.run(scenario())

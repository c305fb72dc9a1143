"""A failed transaction leaves nothing enrolled, on the real stores: Redis (transactions, work queue, face
records), milvus-lite (vectors) and the local blob store, with QueueWorkers over them. The analysis
backend is the unit tests' scripted one (no model is the point here).

The sequence the fix is for: an attempt enrols a face (record, then vector) and its worker dies before the
transaction completes; the next attempts fail; the worker that then finds the entry past max_deliveries
gives the transaction up. The client reads `failed`, so the face must not stay searchable, listed or
proven, or the client's retry enrols the same person twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis.asyncio import Redis

from serve_app.domain.faces import GalleryEntry
from serve_app.domain.outcomes import Outcome
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.commands import FaceSearchCommand
from serve_app.pipelines.processing import TransactionProcessor, enrolled_face_id
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.unit.fakes import (
    EMBEDDING_SIZE,
    TEST_POLICY,
    Color,
    ScriptedAnalysis,
    embedding,
    face,
    solid_png,
)

TENANT = "tenant-a"
RED: Color = (200, 30, 30)
GIVE_UP = "The transaction could not be processed."
CRASH = RuntimeError("the model crashed")  # every later attempt fails
POLICY = WorkerPolicy(
    concurrency=2,
    stale_after_s=0.3,
    max_deliveries=2,
    claim_block_ms=50,
    reclaim_every_s=0.05,
    backoff_s=0.05,
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("failed-transactions"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


class WorkerKilled(Exception):
    """Stands for the worker process dying: nothing after the raising call runs."""


class DiesBeforeCompleting(RedisTransactionStore):
    """The real store, on a worker that is killed when it is about to complete a transaction."""

    async def complete(self, reference_id: str, result: Outcome) -> bool:
        raise WorkerKilled(reference_id)


class PausingGallery(MilvusGalleryStore):
    """The real gallery, holding every add() until `release` is set: the point between an enrolment's
    record (written) and its vector (not yet)."""

    waiting: asyncio.Event
    release: asyncio.Event

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        self.waiting.set()
        await self.release.wait()
        await super().add(entries)


@dataclass
class Stores:
    redis: Redis
    prefix: str
    transactions: RedisTransactionStore
    records: RedisFaceRecordStore
    gallery: MilvusGalleryStore
    blobs: LocalBlobStore
    analysis: ScriptedAnalysis

    def processor(self, transactions: RedisTransactionStore | None = None) -> TransactionProcessor:
        return TransactionProcessor(
            transactions or self.transactions,
            self.records,
            self.gallery,
            self.blobs,
            self.analysis,
            TEST_POLICY,
        )

    async def submit(self, client_reference: str | None = None, allow_override: bool = False) -> Transaction:
        service = TransactionService(self.transactions, self.blobs, 40_000_000)
        command = FaceSearchCommand(
            TENANT, solid_png(RED), client_reference, allow_override=allow_override, enroll_face=True
        )
        return await service.create_face_search(command)

    async def enrolled(self) -> set[str]:
        """The tenant's faces as a client observes them: listed (records) and searchable (vectors), which
        must agree."""
        listed = {face_id for _tenant, face_id in await self.records.all_face_ids(TENANT)}
        searchable = {match.face_id for match in await self.gallery.search(TENANT, embedding(1), 10, -1.0)}
        assert listed == searchable, (listed, searchable)
        return listed

    async def enrol_then_die(self, tx: Transaction) -> None:
        """An attempt claimed by a worker that enrols the face and is killed before completing."""
        [entry] = await self.transactions.claim("worker-killed", 1, 100)
        assert entry.reference_id == tx.reference_id
        dying = DiesBeforeCompleting(self.redis, prefix=self.prefix)
        with pytest.raises(WorkerKilled):
            await self.processor(dying).process(tx.reference_id)
        assert enrolled_face_id(tx.reference_id) in await self.enrolled()

    async def run_until_final(self, tx: Transaction) -> Transaction:
        """A live worker runs until the transaction is final and its entry acknowledged."""
        stop = asyncio.Event()
        worker = QueueWorker("worker-alive", self.transactions, self.processor(), POLICY)
        task = asyncio.create_task(worker.run(stop))
        try:
            for _ in range(1200):  # a hang guard of about a minute, not a speed bound
                current = await self.transactions.get(tx.reference_id)
                if current is not None and current.state.is_final and await self.transactions.depth() == 0:
                    return current
                await asyncio.sleep(0.05)
            raise AssertionError(f"transaction {tx.reference_id} never ended")
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def real_stores(
    servers: EmbeddedServices, blob_dir: Path, gallery_type: type[MilvusGalleryStore] = MilvusGalleryStore
) -> AsyncIterator[Stores]:
    redis = connect_redis(str(servers.redis_url))
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    gallery = gallery_type(
        str(servers.milvus_uri),
        f"faces_{uuid.uuid4().hex[:8]}",
        model_version=TEST_POLICY.model_version,
        dimension=EMBEDDING_SIZE,
    )
    analysis = ScriptedAnalysis()
    analysis.faces_by_color[RED] = [face(embedding(1))]
    try:
        yield Stores(
            redis,
            prefix,
            RedisTransactionStore(redis, prefix=prefix),
            RedisFaceRecordStore(redis, prefix=prefix),
            gallery,
            LocalBlobStore(blob_dir),
            analysis,
        )
    finally:
        await gallery.close()
        await redis.aclose()


def test_a_transaction_given_up_after_its_face_was_enrolled_leaves_nothing_and_a_retry_enrols_once(
    servers: EmbeddedServices, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with real_stores(servers, tmp_path) as world:
            tx = await world.submit()
            await world.enrol_then_die(tx)
            world.analysis.failures.extend(
                RuntimeError("model crashed") for _ in range(POLICY.max_deliveries)
            )

            final = await world.run_until_final(tx)

            assert final.state is TransactionState.FAILED and final.error == GIVE_UP
            assert await world.enrolled() == set()
            assert await world.blobs.get(tx.image_key) is None
            # The client reads `failed` and submits the photo again: one face, that of the retry.
            world.analysis.failures.clear()
            retry = await world.submit()
            assert (await world.run_until_final(retry)).state is TransactionState.COMPLETED
            assert await world.enrolled() == {enrolled_face_id(retry.reference_id)}

    asyncio.run(scenario())


def test_a_given_up_override_that_had_replaced_the_earlier_face_leaves_the_reference_empty_and_says_so(
    servers: EmbeddedServices, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with real_stores(servers, tmp_path) as world:
            first = await world.submit("customer-1", allow_override=True)
            assert (await world.run_until_final(first)).state is TransactionState.COMPLETED
            override = await world.submit("customer-1", allow_override=True)
            await world.enrol_then_die(override)  # it replaced the first face, then its worker died
            assert await world.enrolled() == {enrolled_face_id(override.reference_id)}
            world.analysis.failures.extend(
                RuntimeError("model crashed") for _ in range(POLICY.max_deliveries)
            )

            final = await world.run_until_final(override)

            assert final.state is TransactionState.FAILED
            assert final.error is not None and final.error.startswith(GIVE_UP)
            assert "no longer stored" in final.error
            assert await world.enrolled() == set()
            assert await world.records.records_for_reference(TENANT, "customer-1") == []
            assert await world.blobs.get(override.image_key) is None

    asyncio.run(scenario())


def test_a_give_up_between_a_stalled_attempts_record_and_vector_leaves_neither(
    servers: EmbeddedServices, tmp_path: Path
) -> None:
    """The give-up of one worker interleaved with the two writes of another, whose lease it outlived."""

    async def scenario() -> None:
        async with real_stores(servers, tmp_path, PausingGallery) as world:
            assert isinstance(world.gallery, PausingGallery)
            world.gallery.waiting, world.gallery.release = asyncio.Event(), asyncio.Event()
            tx = await world.submit()
            stalled = asyncio.create_task(world.processor().process(tx.reference_id))
            await asyncio.wait_for(world.gallery.waiting.wait(), 60)
            own = enrolled_face_id(tx.reference_id)
            assert await world.records.get(TENANT, own) is not None  # the record is written, no vector yet

            await world.processor().give_up(tx.reference_id, GIVE_UP)
            world.gallery.release.set()
            await asyncio.wait_for(stalled, 60)

            final = await world.transactions.get(tx.reference_id)
            assert final is not None and final.state is TransactionState.FAILED
            assert await world.enrolled() == set()
            assert await world.blobs.get(tx.image_key) is None

    asyncio.run(scenario())

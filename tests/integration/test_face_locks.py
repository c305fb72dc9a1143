"""The face lock (pipelines/lifecycle.py) on the real stores: Redis (records, locks, transactions, the work
queue), Milvus (vectors) and the local blob store.

A holder paused on purpose: its event loop is blocked (as in a stalled process, a long GC pause or a stopped
VM), so it neither renews its lock nor does anything else, while a second holder, in a thread with its own
event loop and its own clients (another process, in effect), waits for the lock to lapse and takes it. When
the first resumes, none of its writes may land: the Redis record writes are refused by Redis (the fence),
the Milvus write is never sent (HeldLock.check).

A reference whose lock stays taken: its transactions end `failed`, with nothing enrolled, after
max_deliveries attempts, instead of being requeued for ever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve_app.domain.errors import LockUnavailable
from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.domain.transactions import TransactionState, new_reference_id
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.commands import FaceSearchCommand
from serve_app.pipelines.lifecycle import FaceLifecycle
from serve_app.pipelines.processing import TransactionProcessor, enrolled_face_id
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import HeldLock, LockPolicy
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.unit.fakes import EMBEDDING_SIZE, TEST_POLICY, Color, ScriptedAnalysis, embedding, face, solid_png

TENANT = "tenant-a"
REFERENCE = "customer-1"
RED: Color = (200, 30, 30)
LOCK = LockPolicy(wait_s=30.0, ttl_s=0.5, max_hold_s=60.0)
HANG_GUARD_S = 60.0  # how long a blocked holder waits for the other before the test fails, never a bound


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("face-locks"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


@dataclass
class Side:
    """One holder's own clients: a Redis pool, a Milvus client, the blob store, and the lifecycle on them."""

    records: PausingRecords
    gallery: MilvusGalleryStore
    blobs: LocalBlobStore
    faces: FaceLifecycle


class PausingRecords(RedisFaceRecordStore):
    """The real record store; `pause_before_put` / `pause_after_put` run around the next put, once, and
    block the event loop (the pause: no renewal, no other task of this holder runs)."""

    pause_before_put: Callable[[], None] | None = None
    pause_after_put: Callable[[], None] | None = None

    async def put(self, record: FaceRecord, lock: HeldLock | None = None) -> None:
        before, self.pause_before_put = self.pause_before_put, None
        if before is not None:
            before()
        await super().put(record, lock)
        after, self.pause_after_put = self.pause_after_put, None
        if after is not None:
            after()


@dataclass
class Names:
    prefix: str
    collection: str
    blob_dir: Path


async def open_side(servers: EmbeddedServices, names: Names) -> Side:
    records = PausingRecords(connect_redis(str(servers.redis_url)), prefix=names.prefix)
    gallery = MilvusGalleryStore(
        str(servers.milvus_uri),
        names.collection,
        model_version=TEST_POLICY.model_version,
        dimension=EMBEDDING_SIZE,
    )
    blobs = LocalBlobStore(names.blob_dir)
    return Side(records, gallery, blobs, FaceLifecycle(records, gallery, blobs, LOCK))


def record(reference_id: str | None = None) -> FaceRecord:
    reference_id = reference_id or new_reference_id()
    return FaceRecord(
        face_id=enrolled_face_id(reference_id),
        tenant_id=TENANT,
        client_reference=REFERENCE,
        proof_key=f"uploads/{TENANT}/{reference_id}",
        model_version=TEST_POLICY.model_version,
        created_at=time.time(),
        reference_id=reference_id,
    )


def wait_blocking(event: threading.Event) -> None:
    """Block the calling thread (for a holder on its event loop: the pause itself) until event is set."""
    if not event.wait(HANG_GUARD_S):
        raise AssertionError("the other holder never got that far")


def pause(paused: threading.Event, until: threading.Event) -> Callable[[], None]:
    """A pause of the holder whose event loop calls it: says it is paused, then blocks until `until`."""

    def blocking() -> None:
        paused.set()
        wait_blocking(until)

    return blocking


async def with_bystander(side: Side) -> None:
    # Another tenant's face: creates the collection, and must survive every removal below.
    await side.gallery.add(
        [GalleryEntry("fbystander", "tenant-b", TEST_POLICY.model_version, embedding(9), 1.0)]
    )


def run_other_holder(
    servers: EmbeddedServices, names: Names, work: Callable[[Side], Awaitable[None]]
) -> tuple[threading.Thread, list[BaseException]]:
    """`work` on a second holder in a thread of its own, with its own event loop and clients."""
    errors: list[BaseException] = []

    async def main() -> None:
        side = await open_side(servers, names)
        try:
            await work(side)
        finally:
            await side.gallery.close()

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


@pytest.fixture
def names(tmp_path: Path) -> Names:
    return Names(f"t{uuid.uuid4().hex[:8]}:", f"faces_{uuid.uuid4().hex[:8]}", tmp_path / "blobs")


async def stored(side: Side, face_id: str) -> tuple[bool, bool]:
    """(its record exists, a vector of it exists)."""
    return (
        await side.records.get(TENANT, face_id) is not None,
        bool(await side.gallery.present(TENANT, [face_id], all_versions=True)),
    )


def test_a_holder_paused_before_its_record_write_writes_nothing_once_another_holds_the_lock(
    servers: EmbeddedServices, names: Names
) -> None:
    async def scenario() -> None:
        side = await open_side(servers, names)
        await with_bystander(side)
        a_paused, b_holds, a_done = threading.Event(), threading.Event(), threading.Event()
        mine, theirs = record(), record()

        async def other_holder(other: Side) -> None:
            await asyncio.to_thread(wait_blocking, a_paused)
            async with other.faces.locked(TENANT, REFERENCE) as lock:  # once the paused holder's lapsed
                await other.faces.enrol(theirs, embedding(2), lock)
                b_holds.set()
                await asyncio.to_thread(wait_blocking, a_done)

        thread, errors = run_other_holder(servers, names, other_holder)
        try:
            side.records.pause_before_put = pause(a_paused, b_holds)
            async with side.faces.locked(TENANT, REFERENCE) as lock:
                with pytest.raises(LockUnavailable):
                    await side.faces.enrol(mine, embedding(1), lock)  # the pause is inside, before the put
                with pytest.raises(LockUnavailable):
                    await side.records.put(mine, lock)  # Redis refuses it, whatever the holder believes
                a_done.set()
        finally:
            a_done.set()
            thread.join(HANG_GUARD_S)
        assert errors == []
        assert await stored(side, mine.face_id) == (False, False)
        assert await stored(side, theirs.face_id) == (True, True)
        assert await side.gallery.present("tenant-b", ["fbystander"]) == {"fbystander"}
        assert await side.records.records_for_reference(TENANT, REFERENCE) == [theirs]
        await side.gallery.close()

    asyncio.run(scenario())


def test_a_holder_paused_between_its_record_and_its_vector_never_writes_the_vector(
    servers: EmbeddedServices, names: Names
) -> None:
    """The paused holder's record was written; the other holder erases the reference meanwhile. The paused
    one then must not add the vector (a vector without its record, debris until reconciliation), nor
    bring the record back."""

    async def scenario() -> None:
        side = await open_side(servers, names)
        await with_bystander(side)
        a_paused, b_erased, a_done = threading.Event(), threading.Event(), threading.Event()
        mine = record()

        async def erasing_holder(other: Side) -> None:
            await asyncio.to_thread(wait_blocking, a_paused)
            async with other.faces.locked(TENANT, REFERENCE) as lock:
                await other.records.mark_erased(TENANT, REFERENCE, time.time(), lock)
                await other.faces.remove(await other.records.records_for_reference(TENANT, REFERENCE), lock)
                b_erased.set()
                await asyncio.to_thread(wait_blocking, a_done)

        thread, errors = run_other_holder(servers, names, erasing_holder)
        try:
            side.records.pause_after_put = pause(a_paused, b_erased)
            async with side.faces.locked(TENANT, REFERENCE) as lock:
                with pytest.raises(LockUnavailable):
                    await side.faces.enrol(mine, embedding(1), lock)
                with pytest.raises(LockUnavailable):
                    await side.records.put(mine, lock)
                a_done.set()
        finally:
            a_done.set()
            thread.join(HANG_GUARD_S)
        assert errors == []
        assert await stored(side, mine.face_id) == (False, False)
        assert await side.gallery.present("tenant-b", ["fbystander"]) == {"fbystander"}
        await side.gallery.close()

    asyncio.run(scenario())


GIVE_UP = "The transaction could not be processed."
POLICY = WorkerPolicy(
    concurrency=2,
    stale_after_s=0.3,
    max_deliveries=2,
    claim_block_ms=50,
    reclaim_every_s=0.05,
    backoff_s=0.05,
)


def test_a_transaction_whose_reference_stays_locked_ends_failed_with_nothing_enrolled(
    servers: EmbeddedServices, names: Names
) -> None:
    """Every attempt times out waiting for the lock (another holder keeps it, renewing it): after
    max_deliveries attempts the transaction is given up, without needing the lock, and nothing of it is
    stored. Before, each timeout requeued the entry with a fresh delivery count, for ever."""

    async def scenario() -> None:
        side = await open_side(servers, names)
        redis = connect_redis(str(servers.redis_url))
        transactions = RedisTransactionStore(redis, prefix=names.prefix)
        analysis = ScriptedAnalysis()
        analysis.faces_by_color[RED] = [face(embedding(1))]
        short_wait = LockPolicy(wait_s=0.2, ttl_s=1.0, max_hold_s=60.0)
        processor = TransactionProcessor(
            transactions,
            side.records,
            side.gallery,
            side.blobs,
            analysis,
            dataclasses.replace(TEST_POLICY, lock=short_wait),
        )
        worker = QueueWorker("worker", transactions, processor, POLICY)
        stop = asyncio.Event()
        try:
            async with side.faces.locked(TENANT, REFERENCE):  # a holder that keeps the reference busy
                service = TransactionService(transactions, side.blobs, 40_000_000)
                tx = await service.create_face_search(
                    FaceSearchCommand(
                        TENANT, solid_png(RED), REFERENCE, allow_override=False, enroll_face=True
                    )
                )
                task = asyncio.create_task(worker.run(stop))
                final = None
                for _ in range(int(HANG_GUARD_S / 0.05)):
                    final = await transactions.get(tx.reference_id)
                    if final is not None and final.state.is_final and await transactions.depth() == 0:
                        break
                    await asyncio.sleep(0.05)
                stop.set()
                await asyncio.wait_for(task, 30)
            assert final is not None and final.state is TransactionState.FAILED, final
            assert final.error == GIVE_UP
            assert final.attempts == POLICY.max_deliveries  # bounded: one attempt per delivery
            assert await stored(side, enrolled_face_id(tx.reference_id)) == (False, False)
            assert await side.blobs.get(tx.image_key) is None
        finally:
            await side.gallery.close()
            await redis.aclose()

    asyncio.run(scenario())

"""Compact finished transactions, the result archive and erasure tombstones against a real redis-server
(serve_app.launch.embedded, 127.0.0.1) and a real blob directory. Nothing is mocked; where the order of two
processes' steps matters, a blob store that pauses inside its write lets the test read in between.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis

from serve_app.domain.outcomes import AgeEstimationOutcome, FaceMatch, FaceSearchOutcome, QualityReport
from serve_app.domain.transactions import (
    Transaction,
    TransactionKind,
    TransactionState,
    new_reference_id,
    upload_key,
)
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.result_archive import ArchiveReport, ResultArchiver, ResultSweeper, archive_finished
from serve_app.pipelines.transactions import TransactionService
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import BlobPage, SweptPage
from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis, text, text_map
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.result_archive import BlobResultArchive, archive_key

T = TypeVar("T")
TENANT = "cl_" + "a" * 24
MATCHES = tuple(FaceMatch(f"f{index:032x}", round(0.9 - index / 50, 6), "") for index in range(10))
SEARCH = FaceSearchOutcome(is_face_found=True, matches=MATCHES, enrolled=True)
AGE = AgeEstimationOutcome(age=31, under_18=0, under_21=0)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("archive") / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def new_tx(
    kind: TransactionKind = TransactionKind.FACE_SEARCH, client_reference: str | None = None
) -> Transaction:
    now = time.time()
    reference_id = new_reference_id()
    return Transaction(
        reference_id=reference_id,
        tenant_id=TENANT,
        kind=kind,
        state=TransactionState.QUEUED,
        created_at=now,
        updated_at=now,
        image_key=upload_key(TENANT, reference_id),
        enroll_face=True,
        client_reference=client_reference,
    )


async def finished(store: RedisTransactionStore, tx: Transaction, outcome: Any) -> Transaction:
    await store.create_and_enqueue(tx)
    await store.mark_processing(tx.reference_id)
    await store.complete(tx.reference_id, outcome)
    final = await store.get(tx.reference_id)
    assert final is not None
    return final


def stores(redis: Redis, directory: Path, **options: Any) -> tuple[RedisTransactionStore, BlobResultArchive]:
    prefix = f"a{uuid.uuid4().hex[:8]}:"
    store = RedisTransactionStore(redis, prefix=prefix, finished_ttl_s=3600, **options)
    return store, BlobResultArchive(LocalBlobStore(directory), retention_s=3600)


def age_files(directory: Path, seconds: float) -> None:
    """Make every file under `directory` last written `seconds` ago."""
    then = time.time() - seconds
    for path in directory.rglob("*"):
        if path.is_file():
            os.utime(path, (then, then))


def test_a_finished_transaction_is_a_compact_hash_and_earlier_hashes_still_read(
    redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, _ = stores(redis, tmp_path)
        try:
            for kind, outcome in (
                (TransactionKind.FACE_SEARCH, SEARCH),
                (TransactionKind.AGE_ESTIMATION, AGE),
            ):
                tx = await finished(store, new_tx(kind, "customer-0001"), outcome)
                assert tx.result == outcome and tx.image_key == upload_key(TENANT, tx.reference_id)
                key = f"{store._prefix}txn:{tx.reference_id}"
                # Every value short enough for Redis' compact hash encoding (ziplist before 7.0).
                assert text(await redis.object("encoding", key)) in ("ziplist", "listpack")
                assert tx.reference_id not in json.dumps(text_map(await redis.hgetall(key)))

            # A hash as the earlier layout wrote it: every field, the result one JSON document whose
            # matches carry their reference (ignored now: references are joined when read).
            legacy_id = new_reference_id()
            await redis.hset(
                f"{store._prefix}txn:{legacy_id}",
                mapping={
                    "reference_id": legacy_id,
                    "tenant_id": TENANT,
                    "kind": "face_search",
                    "state": "completed",
                    "created_at": "1.5",
                    "updated_at": "2.5",
                    "image_key": f"uploads/{TENANT}/{legacy_id}",
                    "enroll_face": "1",
                    "allow_override": "0",
                    "attempts": "1",
                    "extra": "{}",
                    "client_reference": "customer-0002",
                    "result": json.dumps(
                        {
                            "is_face_found": True,
                            "matched_faces": [["fabc", 0.5, "customer-9"]],
                            "enrolled": True,
                        }
                    ),
                },
            )
            legacy = await store.get(legacy_id)
            assert legacy is not None and legacy.client_reference == "customer-0002"
            assert legacy.result == FaceSearchOutcome(True, (FaceMatch("fabc", 0.5, ""),), enrolled=True)
        finally:
            await redis.aclose()

    run(scenario())


class PausingBlobs(LocalBlobStore):
    """A real blob directory whose writes wait for the test (to read in between) or fail."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.writing = asyncio.Event()
        self.proceed = asyncio.Event()
        self.fail = False

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        self.writing.set()
        await self.proceed.wait()
        if self.fail:
            raise OSError("disk full")
        await super().put(key, data, content_type)


def test_archiving_moves_a_result_without_a_moment_where_it_cannot_be_read(
    redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, _ = stores(redis, tmp_path, archive_after_s=60)
        blobs = PausingBlobs(tmp_path / "results")
        archive = BlobResultArchive(blobs, retention_s=3600)
        service = TransactionService(store, LocalBlobStore(tmp_path / "blobs"), 40_000_000, archive=archive)
        try:
            search = await finished(store, new_tx(client_reference="customer-0003"), SEARCH)
            age = await finished(store, new_tx(TransactionKind.AGE_ESTIMATION), AGE)
            failed = new_tx()
            await store.create_and_enqueue(failed)
            await store.fail(failed.reference_id, "The uploaded image is no longer available.")
            failed = await store.get(failed.reference_id) or failed
            originals = [search, age, failed]
            # Within the hot window nothing is due.
            assert await archive_finished(store, archive, hot_window_s=60) == ArchiveReport(0, 0, 0)

            # A write that fails leaves every Redis copy in place.
            blobs.fail = True
            blobs.proceed.set()
            with pytest.raises(OSError):
                await archive_finished(store, archive, hot_window_s=0)
            for tx in originals:
                assert await store.get(tx.reference_id) == tx

            # The archiver pauses inside its first write: the result reads from Redis meanwhile.
            blobs.fail = False
            blobs.proceed.clear()
            blobs.writing.clear()
            mover = asyncio.create_task(archive_finished(store, archive, hot_window_s=0))
            await blobs.writing.wait()
            assert await service.get_for_tenant(TENANT, search.reference_id) == search
            blobs.proceed.set()
            report = await mover
            assert (report.archived, report.dropped, report.expired) == (3, 3, 0)

            # Gone from Redis (hash and to-do entry), read from the archive exactly as stored before.
            assert await redis.keys(f"{store._prefix}txn:*") == []
            assert await redis.xlen(f"{store._prefix}sys:tx-finished") == 0
            for tx in originals:
                assert await store.get(tx.reference_id) is None
                assert await service.get_for_tenant(TENANT, tx.reference_id) == tx
            with pytest.raises(Exception, match="reference_id"):
                await service.get_for_tenant("cl_" + "b" * 24, search.reference_id)  # another tenant's
        finally:
            await redis.aclose()

    run(scenario())


def test_an_archived_result_ends_with_its_retention(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, _ = stores(redis, tmp_path, archive_after_s=1)
        now = [time.time()]
        blobs = LocalBlobStore(tmp_path / "results")
        archive = BlobResultArchive(blobs, retention_s=100, clock=lambda: now[0])
        try:
            tx = await finished(store, new_tx(), SEARCH)
            await archive_finished(store, archive, hot_window_s=0)
            assert await archive.get(tx.reference_id) == tx
            now[0] = tx.updated_at + 101  # past the retention: gone, even before a sweep deletes the file
            assert await archive.get(tx.reference_id) is None
            assert await blobs.get(archive_key(tx.reference_id)) is not None
            page = await archive.sweep_page(None, archived_after_s=0, limit=100)
            assert (page.removed, page.after) == (0, None)  # the file is younger than 100 s
            age_files(tmp_path / "results", 101)
            assert (await archive.sweep_page(None, archived_after_s=0, limit=100)).removed == 1
            assert await blobs.get(archive_key(tx.reference_id)) is None
        finally:
            await redis.aclose()

    run(scenario())


class PausingArchive:
    """The real archive, logging each put as (holder, reference_id); `pause` runs inside the next put."""

    def __init__(self, inner: BlobResultArchive, holder: str, log: list[tuple[str, str]]) -> None:
        self._inner = inner
        self._holder = holder
        self._log = log
        self.pause: Callable[[], Awaitable[object]] | None = None

    async def put(self, tx: Transaction) -> None:
        self._log.append((self._holder, tx.reference_id))
        pause, self.pause = self.pause, None
        if pause is not None:
            await pause()
        await self._inner.put(tx)

    async def get(self, reference_id: str) -> Transaction | None:
        return await self._inner.get(reference_id)

    async def sweep_page(self, after: str | None, archived_after_s: float, limit: int) -> SweptPage:
        return await self._inner.sweep_page(after, archived_after_s, limit)


def test_one_archiver_at_a_time_and_a_dead_holder_loses_the_lease(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, archive = stores(redis, tmp_path, archive_after_s=1)
        lease = RedisLease(redis, "result-archive", store._prefix)
        log: list[tuple[str, str]] = []
        held_up = PausingArchive(archive, "worker-1", log)
        first = ResultArchiver(store, held_up, lease, hot_window_s=0, every_s=0.1)
        second = ResultArchiver(store, archive, lease, hot_window_s=0, every_s=0.1)
        inside = asyncio.Event()
        try:
            await finished(store, new_tx(TransactionKind.AGE_ESTIMATION), AGE)

            async def while_inside() -> None:
                inside.set()
                assert await second.run_once("worker-2") is None  # worker-1 holds it during its pass

            held_up.pause = while_inside
            report = await first.run_once("worker-1")
            assert inside.is_set() and report is not None and report.dropped == 1
            # Given back at the end of the pass: the next one is whoever asks first.
            assert await second.run_once("worker-2") is not None
            # A holder that died holding it: taken once it lapsed (3 periods).
            assert await lease.acquire("dead-worker", 0.3)
            assert await second.run_once("worker-2") is None
            await asyncio.sleep(0.4)
            assert await second.run_once("worker-2") is not None
        finally:
            await redis.aclose()

    run(scenario())


def test_an_archiver_whose_lease_lapsed_mid_pass_stops_at_its_next_batch(
    redis_url: str, tmp_path: Path
) -> None:
    """worker-1 is held up inside its first batch past its lease; worker-2 takes the lease and starts a
    pass, which is held up in turn (inside its first write) until worker-1 has resumed and returned.
    worker-1 must not go on to a second batch beside worker-2's pass: it renews before every batch and
    finds the lease taken."""

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, archive = stores(redis, tmp_path, archive_after_s=1)
        lease = RedisLease(redis, "result-archive", store._prefix)
        log: list[tuple[str, str]] = []
        first_view, second_view = (
            PausingArchive(archive, "worker-1", log),
            PausingArchive(archive, "worker-2", log),
        )
        # Leases of 30 s: worker-1's lapses because the test expires it, never because the machine is slow.
        first = ResultArchiver(store, first_view, lease, hot_window_s=0, every_s=10, batch=1)
        second = ResultArchiver(store, second_view, lease, hot_window_s=0, every_s=10, batch=1)
        lapsed, second_inside, first_returned = asyncio.Event(), asyncio.Event(), asyncio.Event()
        try:
            txs = [await finished(store, new_tx(TransactionKind.AGE_ESTIMATION), AGE) for _ in range(4)]

            async def past_the_lease() -> None:
                await redis.delete(f"{store._prefix}sys:lease:result-archive")  # its ttl ran out
                lapsed.set()
                await second_inside.wait()

            async def until_first_returned() -> None:
                second_inside.set()
                await first_returned.wait()

            first_view.pause = past_the_lease
            second_view.pause = until_first_returned
            first_pass = asyncio.create_task(first.run_once("worker-1"))
            await lapsed.wait()  # worker-1 is inside its first batch; its lease has lapsed
            second_pass = asyncio.create_task(second.run_once("worker-2"))
            assert await first_pass is None  # it lost the lease during its pass
            first_returned.set()
            report = await second_pass
            assert report is not None
            assert [entry for entry in log if entry[0] == "worker-1"] == [("worker-1", txs[0].reference_id)]
            for tx in txs:  # every result archived once the passes are over, and readable
                assert await archive.get(tx.reference_id) is not None
            assert await store.finished_before(0, 10) == []
        finally:
            await redis.aclose()

    run(scenario())


def test_an_erasure_tombstone_is_kept_hashed_and_expires(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        prefix = f"e{uuid.uuid4().hex[:8]}:"
        records = RedisFaceRecordStore(redis, prefix=prefix, erasure_ttl_s=100)
        try:
            assert await records.erased_at(TENANT, "customer-0004") is None
            await records.mark_erased(TENANT, "customer-0004", 1_800_000_000.25)
            assert await records.erased_at(TENANT, "customer-0004") == 1_800_000_000.25
            assert await records.erased_at("cl_" + "b" * 24, "customer-0004") is None
            [key] = [text(key) for key in await redis.keys(f"{prefix}*")]
            assert "customer-0004" not in key and "customer-0004" not in text(await redis.get(key))
            assert 0 < await redis.ttl(key) <= 100
        finally:
            await redis.aclose()

    run(scenario())


def test_quality_reports_still_round_trip(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, archive = stores(redis, tmp_path, archive_after_s=1)
        quality = QualityReport(("blurry",), 80.5, 0.912, 12.3, 0.05, 0.4, -3.5)
        outcome = FaceSearchOutcome(True, MATCHES[:2], probe_quality=quality, unindexed_faces=(quality,))
        try:
            tx = await finished(store, new_tx(), outcome)
            assert tx.result == outcome
            await archive_finished(store, archive, hot_window_s=0)
            assert await archive.get(tx.reference_id) == tx
        finally:
            await redis.aclose()

    run(scenario())


class PagedBlobs(LocalBlobStore):
    """A real blob directory that records every walk of it; at_page[n] runs inside the n-th (from 1)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.pages: list[tuple[str | None, int]] = []  # (cursor, limit) of each sweep_old
        self.at_page: dict[int, Callable[[], Awaitable[object]]] = {}

    async def sweep_old(self, after: str | None, older_than_s: float, limit: int) -> SweptPage:
        self.pages.append((after, limit))
        hook = self.at_page.pop(len(self.pages), None)
        if hook is not None:
            await hook()
        return await super().sweep_old(after, older_than_s, limit)

    async def scan_old(self, after: str | None, older_than_s: float, limit: int) -> BlobPage:
        raise AssertionError("the retention sweep deletes by age: it never lists keys")


def files_under(directory: Path) -> int:
    return sum(1 for path in directory.rglob("*") if path.is_file())


def test_the_retention_sweep_walks_a_page_at_a_time_and_stops_when_its_lease_lapses(
    redis_url: str, tmp_path: Path
) -> None:
    """40 archived results past their retention, swept 5 at a time: the store is only ever asked for a
    page after a cursor (the sweep's memory is one page), the lease is renewed after each page, and a
    holder whose lease lapsed during its third page (another worker took it) stops there. The next holder
    resumes from the last cursor the first one wrote and deletes the rest, never the young copy."""

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store, _ = stores(redis, tmp_path, archive_after_s=1)
        blobs = PagedBlobs(tmp_path / "results")
        archive = BlobResultArchive(blobs, retention_s=100)
        lease = RedisLease(redis, "result-sweep", store._prefix)
        sweeper = ResultSweeper(archive, lease, hot_window_s=0, every_s=3600, lease_s=30, page=5)
        try:
            for _ in range(40):
                await archive.put(await finished(store, new_tx(TransactionKind.AGE_ESTIMATION), AGE))
            age_files(tmp_path / "results", 200)  # past the 100 s retention
            young = await finished(store, new_tx(TransactionKind.AGE_ESTIMATION), AGE)
            await archive.put(young)

            async def lapse_and_take_over() -> None:
                await redis.delete(f"{store._prefix}sys:lease:result-sweep")  # its ttl ran out meanwhile
                assert await lease.acquire("worker-2", 30)

            blobs.at_page[3] = lapse_and_take_over
            assert await sweeper.run_once("worker-1") is None  # it lost the lease during its third page
            first_pages = list(blobs.pages)
            assert [limit for _, limit in first_pages] == [5, 5, 5]  # and asked for no fourth
            assert first_pages[0][0] is None and None not in (first_pages[1][0], first_pages[2][0])
            assert files_under(tmp_path / "results") > 2 * 20  # most of the old copies are still there

            await lease.release("worker-2")  # worker-2 died before its pass; worker-3 goes on
            blobs.pages.clear()
            report = await sweeper.run_once("worker-3")
            assert report is not None and report.resumed
            # From the cursor of the last page worker-1 checkpointed (the one its third page started at).
            assert blobs.pages[0] == (first_pages[2][0], 5)
            assert {limit for _, limit in blobs.pages} == {5} and len(blobs.pages) > 1
            assert await archive.get(young.reference_id) == young
            assert files_under(tmp_path / "results") == 2  # the young copy and its type file
            # The pass is complete: the next one is due an interval later, not at once.
            blobs.pages.clear()
            assert await sweeper.run_once("worker-3") is None and blobs.pages == []
        finally:
            await redis.aclose()

    run(scenario())

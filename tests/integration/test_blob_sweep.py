"""The orphaned-blob sweep (pipelines/blob_sweep.py) on the real stores: the file blob store, and
redis-server (serve_app.launch.embedded, 127.0.0.1) for face records and transactions.

The sweep reads the blob directory a page at a time and asks Redis who owns each page's blobs; it never
loads the gallery's proof keys. Ages are set on the files themselves (os.utime), so nothing waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.domain.faces import FaceRecord
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.domain.transactions import (
    Transaction,
    TransactionKind,
    TransactionState,
    new_reference_id,
    upload_key,
)
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.blob_sweep import BlobSweep, SweepReport
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore

TENANT = "cl_" + "c" * 24
GRACE_S = 3600.0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("blob-sweep") / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def files_of(directory: Path, key: str) -> list[Path]:
    """The blob's data file and its sidecar (the layout of serve_app/stores/blobs.py)."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    path = directory / digest[:2] / digest[2:4] / digest
    return [path, path.with_suffix(".type")]


def age(paths: list[Path], seconds: float) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def test_scan_old_pages_through_every_old_blob_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LocalBlobStore(tmp_path)
        old = [f"uploads/{TENANT}/old-{n}" for n in range(25)]
        young = [f"uploads/{TENANT}/young-{n}" for n in range(5)]
        for key in old + young:
            await store.put(key, b"x", "image/jpeg")
        for key in old:
            age(files_of(tmp_path, key), 2 * GRACE_S)
        # A blob stored before keys were recorded (its sidecar holds the type alone), and the temporary
        # file of a write interrupted long ago.
        unnamed = files_of(tmp_path, "uploads/legacy/blob")
        unnamed[0].parent.mkdir(parents=True, exist_ok=True)
        unnamed[0].write_bytes(b"x")
        unnamed[1].write_text("image/jpeg")
        temporary = unnamed[0].parent / ".tmp-interrupted"
        temporary.write_bytes(b"partial")
        age([*unnamed, temporary], 2 * GRACE_S)

        seen: list[str] = []
        unnamed_count = pages = 0
        after: str | None = None
        while True:
            page = await store.scan_old(after, GRACE_S, 4)
            pages += 1
            seen += page.keys
            unnamed_count += page.unnamed
            if page.after is None:
                break
            assert after is None or page.after > after  # the cursor only moves forward
            after = page.after
        assert sorted(seen) == sorted(old)  # each old blob once, no young one
        assert unnamed_count == 1
        assert pages > 1
        assert not temporary.exists()
        assert await store.get(old[0]) == (b"x", "image/jpeg")  # the type still reads back alone

    asyncio.run(scenario())


def test_the_sweep_removes_only_blobs_no_record_and_no_unfinished_transaction_owns(
    redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        prefix = f"s{uuid.uuid4().hex[:8]}:"
        records = RedisFaceRecordStore(redis, prefix=prefix)
        transactions = RedisTransactionStore(redis, prefix=prefix)
        blobs = LocalBlobStore(tmp_path)

        async def upload(old: bool = True) -> str:
            key = upload_key(TENANT, new_reference_id())
            await blobs.put(key, b"x", "image/jpeg")
            if old:
                age(files_of(tmp_path, key), 2 * GRACE_S)
            return key

        def reference_of(key: str) -> str:
            return key.rsplit("/", 1)[1]

        async def transaction(key: str, final: bool) -> None:
            now = time.time()
            tx = Transaction(
                reference_id=reference_of(key), tenant_id=TENANT, kind=TransactionKind.FACE_SEARCH,
                state=TransactionState.QUEUED, created_at=now, updated_at=now, image_key=key,
                enroll_face=True,
            )  # fmt: skip
            await transactions.create_and_enqueue(tx)
            if final:
                await transactions.mark_processing(tx.reference_id)
                await transactions.complete(tx.reference_id, FaceSearchOutcome(is_face_found=False))

        try:
            proofs = [await upload() for _ in range(5)]  # enrolled faces' proofs
            for key in proofs:
                reference_id = reference_of(key)
                await records.put(
                    FaceRecord(enrolled_face_id(reference_id), TENANT, None, key, "v", 1.0, reference_id)
                )
            never_enqueued = await upload()  # the ingress died between the upload and the transaction
            queued = await upload()  # a transaction still waiting for a worker
            await transaction(queued, final=False)
            finished_without_face = await upload()  # final, nothing enrolled, its deletion was lost
            await transaction(finished_without_face, final=True)
            fresh = await upload(old=False)  # younger than the grace period
            elsewhere = "results/" + new_reference_id()  # not an upload: nobody's to judge
            await blobs.put(elsewhere, b"x", "application/json")
            age(files_of(tmp_path, elsewhere), 2 * GRACE_S)

            cursors: list[str] = []

            async def checkpoint(cursor: str) -> None:
                cursors.append(cursor)

            report = SweepReport()
            await BlobSweep(blobs, records, transactions, GRACE_S, page=2).run(None, checkpoint, report)

            assert report.removed == 2
            for key in (never_enqueued, finished_without_face):
                assert await blobs.get(key) is None
            for key in (*proofs, queued, fresh, elsewhere):
                assert await blobs.get(key) is not None, key
            assert len(cursors) >= 2 and cursors == sorted(cursors)  # a checkpoint after every page
        finally:
            await redis.aclose()

    asyncio.run(scenario())

"""A re-index interleaved with the removals of the same face, on real Redis and milvus-lite: an erasure of
the face's client_reference, or a deletion of a face enrolled without one, that lands while the re-index is
about to write the face back leaves nothing of the face (no record, no vector, no listing).

Before the re-index took the face's lock, it re-read the record, the removal ran, and the re-index wrote
the record back: an erased reference was listed again. The removal is started from inside the re-index's
record write, the moment that race needs; it then either completes at once (no lock held: the old code) or
waits for the re-index to release the lock, which the test gives it a bounded moment to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from models.types import AnalyzedFace, DetectedFace
from serve_app.domain.faces import FaceRecord
from serve_app.launch.embedded import EmbeddedServices
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.reindex import ImageLimits, ReindexState, reindex_tenant
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import HeldLock
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from tests.unit.fakes import TEST_LOCK

OLD_VERSION = "face_v0_retired"
NEW_VERSION = "face_v9_races"
DIMENSION = 8
TENANT = "tenant-races"
# How long the removal is given to finish while the re-index holds the record write back: ample for a
# removal that takes no lock; one that waits on the lock simply finishes after the re-index.
REMOVAL_HEAD_START_S = 3.0


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("reindex-races"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


class OneFace:
    """The analysis backend stand-in: the store interleaving is under test, not the models."""

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        detection = DetectedFace(
            box=np.array([0, 0, image.shape[1], image.shape[0]], dtype=np.float32),
            landmarks=np.zeros((5, 2), dtype=np.float32),
            score=0.99,
        )
        embedding = np.ones(DIMENSION, dtype=np.float32) / np.sqrt(DIMENSION)
        return [AnalyzedFace(detection=detection, embedding=embedding, age=None)]


class RemovalDuringRecordWrite(RedisFaceRecordStore):
    """The re-index's record write starts a removal first and gives it a head start."""

    removal: Any = None
    removal_task: asyncio.Task[Any] | None = None

    async def put(self, record: FaceRecord, lock: HeldLock | None = None) -> None:
        if record.model_version == NEW_VERSION and self.removal is not None and self.removal_task is None:
            self.removal_task = asyncio.create_task(self.removal())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.removal_task), REMOVAL_HEAD_START_S)
        await super().put(record, lock)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@contextlib.asynccontextmanager
async def _stores(
    backends: EmbeddedServices, tmp_path: Path
) -> AsyncIterator[tuple[RemovalDuringRecordWrite, MilvusGalleryStore, LocalBlobStore, GalleryService]]:
    assert backends.redis_url is not None and backends.milvus_uri is not None
    redis = connect_redis(backends.redis_url)
    prefix = f"r{uuid.uuid4().hex[:8]}:"
    records = RemovalDuringRecordWrite(redis, prefix=prefix)
    gallery = MilvusGalleryStore(
        backends.milvus_uri, f"races_{uuid.uuid4().hex[:8]}", model_version=NEW_VERSION, dimension=DIMENSION
    )
    blobs = LocalBlobStore(tmp_path / "blobs")
    service = GalleryService(
        records,
        gallery,
        blobs,
        RedisAuditLog(redis, prefix=prefix),
        subject_key=b"races",
        model_version=NEW_VERSION,
        lock=TEST_LOCK,
    )
    try:
        yield records, gallery, blobs, service
    finally:
        await gallery.close()
        await redis.aclose()


@pytest.mark.parametrize("client_reference", ["customer-erased", None])
def test_a_removal_during_a_reindex_is_never_undone(
    backends: EmbeddedServices, tmp_path: Path, client_reference: str | None
) -> None:
    face_id = "f" + uuid.uuid4().hex

    async def scenario() -> None:
        async with _stores(backends, tmp_path) as (records, gallery, blobs, service):
            await blobs.put("proof-1", _png(), "image/png")
            await records.put(
                FaceRecord(face_id, TENANT, client_reference, "proof-1", OLD_VERSION, time.time(), "r1")
            )
            if client_reference is not None:
                records.removal = lambda: service.erase_reference(TENANT, "operator", client_reference)
            else:
                records.removal = lambda: service.delete_face(TENANT, "operator", face_id)
            report = await reindex_tenant(
                TENANT,
                records=records,
                gallery=gallery,
                blobs=blobs,
                analysis=OneFace(),
                model_version=NEW_VERSION,
                limits=ImageLimits(40_000_000, 1920),
                state=ReindexState.load(tmp_path / "state.json"),
                lock=TEST_LOCK,
            )
            assert records.removal_task is not None
            await records.removal_task  # the removal finishes, before or after the re-index

            assert report.reindexed + len(report.unusable) == 1
            assert await records.get(TENANT, face_id) is None
            assert await gallery.page_ids(TENANT, None, 10) == ([], None)
            page, _ = await records.page(TENANT, None, 10)
            assert page == []
            if client_reference is not None:
                assert await records.records_for_reference(TENANT, client_reference) == []
            assert await blobs.get("proof-1") is None
            # Nothing the re-index wrote can be searched either.
            probe = np.ones(DIMENSION, dtype=np.float32) / np.sqrt(DIMENSION)
            assert await gallery.search(TENANT, probe, 5, -1.0) == []

    asyncio.run(scenario())

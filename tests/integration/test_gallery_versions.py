"""A removed face leaves no vector in any model version's collection, on real Redis and on milvus-lite and a
Milvus server (the `gallery_backend` fixture).

A re-index (serve_app/pipelines/reindex.py) writes a face's vector into the serving version's collection and
leaves the one an older version enrolled in that version's collection. Deletion and erasure used to remove
the vector from the serving version's collection only: the erased person could still be found by switching
back to the older version, or by anyone reading its collection. Reconciliation only scanned the serving
version, so it never found such leftovers either.

Each test enrols a face under version A (record and vector), re-indexes it to version B through the real
pipeline, then removes it and asks every collection of the gallery for the face: a version's store,
`page_ids`, and a search with the face's own vector. The interleavings force an erasure into a running
re-index of the same face at the two moments that matter: while the re-index analyses the proof (before it
takes the face's lock) and while it writes the record back (holding it), with the erasure issued by a
replica serving either version. The face analysis is a stand-in: the store interleaving is under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pymilvus import MilvusClient

from models.types import AnalyzedFace, DetectedFace
from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.domain.transactions import new_reference_id
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.pipelines.reconcile import ReconcilePolicy, Reconciler
from serve_app.pipelines.reindex import ImageLimits, ReindexState, reindex_tenant
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import HeldLock
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_reconcile import RedisReconcileState
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.integration.conftest import GalleryBackend
from tests.unit.fakes import TEST_LOCK

VERSION_A = "face_va_retired"
VERSION_B = "face_vb_serving"
DIMENSION_A = 8  # versions differ in dimension, as real model upgrades may
DIMENSION_B = 16
TENANT = "tenant-versions"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("versions-redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def unit(seed: int, dimension: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(dimension).astype(np.float32)
    normalized: np.ndarray = vector / np.linalg.norm(vector)
    return normalized


class StandInAnalysis:
    """One face per image with a fixed version-B embedding; `before` runs inside the analysis (a re-index
    is between reading the record and taking the face's lock there)."""

    before: Callable[[], Awaitable[None]] | None = None

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        if self.before is not None:
            await self.before()
        detection = DetectedFace(
            box=np.array([0, 0, image.shape[1], image.shape[0]], dtype=np.float32),
            landmarks=np.zeros((5, 2), dtype=np.float32),
            score=0.99,
        )
        return [AnalyzedFace(detection=detection, embedding=unit(2, DIMENSION_B), age=None)]


class HookedRecords(RedisFaceRecordStore):
    """`during_put` runs inside the re-index's write of the version-B record, under the face's lock."""

    during_put: Callable[[], Awaitable[None]] | None = None

    async def put(self, record: FaceRecord, lock: HeldLock | None = None) -> None:
        hook = self.during_put
        if hook is not None and record.model_version == VERSION_B:
            self.during_put = None  # once
            await hook()
        await super().put(record, lock)


@dataclass
class Rig:
    uri: str
    collection: str  # the gallery's collection prefix (one collection per version below it)
    records: HookedRecords
    old: MilvusGalleryStore  # version A's collection (a replica not yet switched serves it)
    new: MilvusGalleryStore  # version B's collection (the serving version)
    blobs: LocalBlobStore
    audit: RedisAuditLog
    transactions: RedisTransactionStore
    state: RedisReconcileState
    analysis: StandInAnalysis
    tmp_path: Path

    def service(self, gallery: MilvusGalleryStore, version: str) -> GalleryService:
        return GalleryService(
            self.records, gallery, self.blobs, self.audit, subject_key=b"versions", model_version=version,
            lock=TEST_LOCK,
        )  # fmt: skip

    async def enrol_under_a(self, client_reference: str | None, seed: int = 1) -> str:
        """A face as version A enrolled it: record, proof and a version-A vector."""
        face_id = enrolled_face_id(new_reference_id())
        proof = f"proof-{face_id}"
        await self.blobs.put(proof, png(), "image/png")
        await self.records.put(
            FaceRecord(face_id, TENANT, client_reference, proof, VERSION_A, time.time(), face_id[1:])
        )
        await self.old.add([GalleryEntry(face_id, TENANT, VERSION_A, unit(seed, DIMENSION_A), time.time())])
        return face_id

    async def reindex(self) -> int:
        report = await reindex_tenant(
            TENANT, records=self.records, gallery=self.new, blobs=self.blobs, analysis=self.analysis,
            model_version=VERSION_B, limits=ImageLimits(40_000_000, 1920),
            state=ReindexState.load(self.tmp_path / f"reindex-{uuid.uuid4().hex}.json"), lock=TEST_LOCK,
        )  # fmt: skip
        return report.reindexed

    async def assert_gone(self, face_id: str, seed: int = 1) -> None:
        """No collection of the gallery holds the face, and nothing lists or finds it."""
        for store, probe in ((self.old, unit(seed, DIMENSION_A)), (self.new, unit(2, DIMENSION_B))):
            assert await store.present(TENANT, [face_id]) == set(), store.collection
            assert face_id not in (await store.page_ids(TENANT, None, 1000))[0], store.collection
            assert face_id not in {m.face_id for m in await store.search(TENANT, probe, 10, -1.0)}
        assert await self.new.present(TENANT, [face_id], all_versions=True) == set()
        assert await self.records.get(TENANT, face_id) is None


def png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@contextlib.asynccontextmanager
async def rig(backend: GalleryBackend, redis_url: str, tmp_path: Path) -> AsyncIterator[Rig]:
    redis = connect_redis(redis_url)
    prefix = f"v{uuid.uuid4().hex[:8]}:"
    collection = f"versions_{uuid.uuid4().hex[:8]}"
    old = MilvusGalleryStore(backend.uri, collection, model_version=VERSION_A, dimension=DIMENSION_A)
    new = MilvusGalleryStore(backend.uri, collection, model_version=VERSION_B, dimension=DIMENSION_B)
    try:
        yield Rig(
            backend.uri, collection, HookedRecords(redis, prefix=prefix), old, new,
            LocalBlobStore(tmp_path / "blobs"),
            RedisAuditLog(redis, prefix=prefix), RedisTransactionStore(redis, prefix=prefix),
            RedisReconcileState(redis, prefix=prefix), StandInAnalysis(), tmp_path,
        )  # fmt: skip
    finally:
        await old.close()
        await new.close()
        await redis.aclose()


def run(scenario: Callable[[], Awaitable[Any]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 300))  # hang guard, not a speed bound


@pytest.mark.parametrize("removal", ["delete", "erase"])
@pytest.mark.parametrize("old_collection", ["loaded", "released"])
def test_removal_after_a_reindex_leaves_no_vector_in_any_version(
    gallery_backend: GalleryBackend, redis_url: str, tmp_path: Path, removal: str, old_collection: str
) -> None:
    """Enrol under A, re-index to B, then delete the face (or erase its reference) through the serving
    version's service: neither collection holds it. `released`: the old collection was released to save
    memory, where a Milvus server cannot evaluate a filter."""

    async def scenario() -> None:
        async with rig(gallery_backend, redis_url, tmp_path) as r:
            reference = "customer-versions" if removal == "erase" else None
            face_id = await r.enrol_under_a(reference)
            kept = await r.enrol_under_a("customer-kept", seed=3)  # another face: left alone
            assert await r.reindex() == 2
            assert await r.old.present(TENANT, [face_id, kept]) == {face_id, kept}  # the re-index kept A's
            assert await r.new.present(TENANT, [face_id, kept]) == {face_id, kept}
            if old_collection == "released":
                await r.old.close()
                client = MilvusClient(uri=r.uri)
                client.release_collection(r.old.collection)
                client.close()

            service = r.service(r.new, VERSION_B)
            if removal == "erase":
                assert reference is not None
                erased = await service.erase_reference(TENANT, "operator", reference)
                assert erased.faces_erased == 1
            else:
                await service.delete_face(TENANT, "operator", face_id)

            if old_collection == "released":  # a store loads its collection again to read it
                r.old = MilvusGalleryStore(
                    r.uri, r.collection, model_version=VERSION_A, dimension=DIMENSION_A
                )
            await r.assert_gone(face_id)
            assert await r.old.present(TENANT, [kept]) == {kept}
            assert await r.new.present(TENANT, [kept]) == {kept}

    run(scenario)


@pytest.mark.parametrize("moment", ["while-analysing", "while-writing-the-record"])
@pytest.mark.parametrize("replica", [VERSION_A, VERSION_B])
def test_erasure_racing_a_reindex_of_the_face_leaves_no_vector(
    gallery_backend: GalleryBackend, redis_url: str, tmp_path: Path, moment: str, replica: str
) -> None:
    """An erasure of the face's reference lands in the middle of a re-index of that face, issued by a
    replica serving version A (not yet switched) or version B. Whichever finishes first, no collection
    holds the face afterwards."""

    async def scenario() -> None:
        async with rig(gallery_backend, redis_url, tmp_path) as r:
            face_id = await r.enrol_under_a("customer-racing")
            gallery = r.old if replica == VERSION_A else r.new
            service = r.service(gallery, replica)
            erasure: list[asyncio.Task[Any]] = []

            async def erase() -> None:
                erasure.append(
                    asyncio.create_task(service.erase_reference(TENANT, "operator", "customer-racing"))
                )
                # The erasure runs to its end, or to the face's lock the re-index holds.
                await asyncio.wait([erasure[0]], timeout=2.0)

            if moment == "while-analysing":
                r.analysis.before = erase
            else:
                r.records.during_put = erase
            reindexed = await r.reindex()
            r.analysis.before = None
            assert len(erasure) == 1
            erased = await erasure[0]
            assert erased.faces_erased == 1
            # Before the lock the erasure wins and the re-index skips the face; under it the re-index
            # finishes first and the erasure then removes both versions' vectors.
            assert reindexed == (0 if moment == "while-analysing" else 1)
            await r.assert_gone(face_id)

    run(scenario)


def test_reconcile_removes_vectors_older_versions_kept_of_removed_faces(
    gallery_backend: GalleryBackend, redis_url: str, tmp_path: Path
) -> None:
    """Leftovers of earlier releases' removals (a version-A vector whose face has no record) are found by
    reconciliation, which scans every version's collection, and removed from all of them; a record whose
    serving vector is lost takes its older copy with it. Faces with a record keep every vector (nothing
    live is removed: a face not yet re-indexed, and the older copy of a re-indexed one)."""

    async def scenario() -> None:
        async with rig(gallery_backend, redis_url, tmp_path) as r:
            erased_earlier = await r.enrol_under_a("customer-erased-earlier", seed=11)
            lost_vector = await r.enrol_under_a("customer-lost-vector", seed=12)
            reindexed = await r.enrol_under_a("customer-reindexed", seed=13)
            assert await r.reindex() == 3
            not_yet = await r.enrol_under_a("customer-not-yet", seed=14)  # enrolled by a replica still on A
            # What an earlier release's erasure left: the record and B's vector gone, A's vector kept.
            await r.records.delete(TENANT, erased_earlier)
            await r.new.delete(TENANT, [erased_earlier, lost_vector])
            await r.old.add(
                [GalleryEntry(erased_earlier, TENANT, VERSION_A, unit(11, DIMENSION_A), time.time())]
            )
            await r.old.add(
                [GalleryEntry(lost_vector, TENANT, VERSION_A, unit(12, DIMENSION_A), time.time())]
            )
            assert await r.old.present(TENANT, [erased_earlier, lost_vector]) == {erased_earlier, lost_vector}

            reconciler = Reconciler(
                r.records, r.new, r.transactions, r.state, "versions",
                ReconcilePolicy(TEST_LOCK, grace_s=0.0, batch=2, model_version=VERSION_B), r.blobs,
            )  # fmt: skip
            # The first pass notes the suspects (and, with no grace, may repair them at its end); the
            # second re-checks whatever is left.
            passes = [await reconciler.run_pass(), await reconciler.run_pass()]
            assert all(report is not None and report.completed for report in passes)
            assert sum(report.vectors_removed for report in passes if report is not None) == 1
            assert sum(report.records_removed for report in passes if report is not None) == 1
            await r.assert_gone(erased_earlier, seed=11)
            await r.assert_gone(lost_vector, seed=12)
            assert await r.old.present(TENANT, [reindexed, not_yet]) == {reindexed, not_yet}
            assert await r.new.present(TENANT, [reindexed, not_yet]) == {reindexed}
            assert await r.records.get(TENANT, not_yet) is not None

    run(scenario)


class DropsAnOlderVersionWhileListing(MilvusGalleryStore):
    """An operator drops an older version's collection right after a removal listed it."""

    dropped = ""

    def _version_collections(self, client: Any, *, building: bool = False) -> list[tuple[str, bool]]:
        listed = super()._version_collections(client, building=building)
        for name, _ in listed:
            if name != self.collection:
                client.drop_collection(name)
                self.dropped = name
        return listed


def test_removal_survives_an_older_version_dropped_meanwhile(
    gallery_backend: GalleryBackend, redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with rig(gallery_backend, redis_url, tmp_path) as r:
            face_id = await r.enrol_under_a(None)
            assert await r.reindex() == 1
            await r.old.close()
            racing = DropsAnOlderVersionWhileListing(
                r.uri, r.collection, model_version=VERSION_B, dimension=DIMENSION_B
            )
            try:
                await r.service(racing, VERSION_B).delete_face(TENANT, "operator", face_id)
                assert racing.dropped == r.old.collection
                assert await racing.present(TENANT, [face_id], all_versions=True) == set()
                assert await r.records.get(TENANT, face_id) is None
            finally:
                await racing.close()

    run(scenario)

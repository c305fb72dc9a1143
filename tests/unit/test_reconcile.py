"""Reconciliation of face records (Redis) against vectors (Milvus)."""

from __future__ import annotations

import asyncio
import time

from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.pipelines.reconcile import ReconcileReport, reconcile
from tests.unit.fakes import World, embedding

GRACE_S = 600.0


def record(tenant_id: str, face_id: str, age_s: float) -> FaceRecord:
    return FaceRecord(
        face_id=face_id,
        tenant_id=tenant_id,
        client_reference=None,
        proof_key=f"proofs/{tenant_id}/{face_id}",
        model_version="unit-test-v1",
        created_at=time.time() - age_s,
        reference_id=f"ref-{face_id}",
    )


async def record_only(world: World, tenant_id: str, face_id: str, age_s: float) -> FaceRecord:
    """What an enrolment interrupted between its two writes leaves: record and proof, no vector."""
    item = record(tenant_id, face_id, age_s)
    await world.record_store.put(item)
    await world.blobs.put(item.proof_key, b"proof", "image/png")
    return item


async def vector_only(world: World, tenant_id: str, face_id: str) -> None:
    """What a removal interrupted after deleting the vector's record would leave (debris)."""
    entry = GalleryEntry(face_id, tenant_id, world.policy.model_version, embedding(len(face_id)), time.time())
    await world.gallery.add([entry])


def test_reconcile_removes_orphans_on_both_sides_and_keeps_recent_records() -> None:
    async def scenario() -> None:
        world = World()
        whole = await world.enrol("tenant-a", "whole", embedding(1))
        await vector_only(world, "tenant-a", "orphan-vector")
        # Another tenant's vector without a record there (a face id names one vector across tenants, so it
        # cannot be "whole" too).
        await vector_only(world, "tenant-b", "whole-b")
        stale = await record_only(world, "tenant-a", "stale-record", age_s=GRACE_S + 60)
        fresh = await record_only(world, "tenant-b", "fresh-record", age_s=5)

        report = await reconcile(world.record_store, world.gallery, world.blobs, grace_s=GRACE_S)

        assert report == ReconcileReport(
            records=3, vectors=3, vectors_removed=2, records_removed=1, records_in_grace=1
        )
        assert await world.gallery.all_face_ids() == {("tenant-a", "whole")}
        assert await world.record_store.all_face_ids() == {
            ("tenant-a", "whole"),
            ("tenant-b", "fresh-record"),
        }
        assert stale.proof_key not in world.blobs.items
        assert fresh.proof_key in world.blobs.items
        assert whole.proof_key in world.blobs.items

    asyncio.run(scenario())


def test_a_record_in_its_grace_period_is_removed_once_the_period_passes() -> None:
    async def scenario() -> None:
        world = World()
        item = await record_only(world, "tenant-a", "pending", age_s=30)
        first = await reconcile(world.record_store, world.gallery, world.blobs, grace_s=60)
        assert (first.records_removed, first.records_in_grace) == (0, 1)
        assert await world.record_store.get("tenant-a", "pending") is not None

        second = await reconcile(world.record_store, world.gallery, world.blobs, grace_s=10)
        assert (second.records_removed, second.records_in_grace) == (1, 0)
        assert await world.record_store.get("tenant-a", "pending") is None
        assert item.proof_key not in world.blobs.items

    asyncio.run(scenario())


def test_without_a_blob_store_records_are_removed_and_blobs_left_alone() -> None:
    async def scenario() -> None:
        world = World()
        item = await record_only(world, "tenant-a", "stale", age_s=GRACE_S * 2)
        report = await reconcile(world.record_store, world.gallery, None, grace_s=GRACE_S)
        assert report.records_removed == 1
        assert await world.record_store.all_face_ids() == set()
        assert item.proof_key in world.blobs.items

    asyncio.run(scenario())


def test_a_consistent_store_is_left_untouched() -> None:
    async def scenario() -> None:
        world = World()
        for index in range(5):
            await world.enrol(f"tenant-{index % 2}", f"face-{index}", embedding(index))
        before_records = await world.record_store.all_face_ids()
        before_blobs = dict(world.blobs.items)
        report = await reconcile(world.record_store, world.gallery, world.blobs, grace_s=0)
        assert report == ReconcileReport(
            records=5, vectors=5, vectors_removed=0, records_removed=0, records_in_grace=0
        )
        assert await world.record_store.all_face_ids() == before_records
        assert await world.gallery.all_face_ids() == before_records
        assert world.blobs.items == before_blobs
        assert world.faults.calls.get("gallery.delete", 0) == 0

    asyncio.run(scenario())


def test_orphaned_blobs_older_than_the_grace_period_are_swept_and_referenced_ones_kept() -> None:
    async def scenario() -> None:
        from serve_app.pipelines.commands import FaceSearchCommand
        from tests.unit.fakes import solid_png

        world = World()
        proof = await world.enrol("tenant-a", "whole", embedding(1))
        queued = await world.transaction_service().create_face_search(
            FaceSearchCommand("tenant-a", solid_png((1, 2, 3)), None, allow_override=False, enroll_face=True)
        )
        await world.blobs.put("uploads/tenant-a/never-enqueued", b"x", "image/png")  # ingress crashed
        await world.blobs.put("uploads/tenant-a/fresh-orphan", b"x", "image/png")
        for key in (proof.proof_key, queued.image_key, "uploads/tenant-a/never-enqueued"):
            world.blobs.written_at[key] -= 7200

        report = await reconcile(
            world.record_store,
            world.gallery,
            world.blobs,
            grace_s=GRACE_S,
            transactions=world.transactions,
            orphan_grace_s=3600,
        )
        assert report.blobs_removed == 1
        assert set(world.blobs.items) == {
            proof.proof_key,
            queued.image_key,
            "uploads/tenant-a/fresh-orphan",
        }

    asyncio.run(scenario())

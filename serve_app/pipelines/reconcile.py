"""Repair faces that exist on only one side of Redis (records) and Milvus (vectors).

Enrolment writes the record first and the vector second, and removal deletes the vector first, so:
- a vector without a record can only be debris of an interrupted removal: delete it;
- a record without a vector is an enrolment interrupted between its two writes. Its transaction is retried
  and completes it, so only records older than the grace period are removed (with their proof image).
- a record of another face model version (a gallery enrolled before an upgrade) has its vector in that
  version's own collection, not in this one: it is left alone (kept for re-indexing, never searched).

Given the transaction store and an upload grace period, it also sweeps orphaned blobs: uploads and proofs
that neither a queued transaction nor a face record refers to (an upload whose transaction was never
created, a file a crash left behind between two deletions), once older than the grace period.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from serve_app.stores.interfaces import BlobStore, FaceRecordStore, GalleryStore, TransactionStore

_RECORD_BATCH = 500


@dataclass(frozen=True)
class ReconcileReport:
    records: int
    vectors: int
    vectors_removed: int
    records_removed: int
    records_in_grace: int
    blobs_removed: int = 0
    records_other_version: int = 0


async def reconcile(
    records: FaceRecordStore,
    gallery: GalleryStore,
    blobs: BlobStore | None = None,
    grace_s: float = 600.0,
    *,
    transactions: TransactionStore | None = None,
    orphan_grace_s: float | None = None,
    model_version: str | None = None,
) -> ReconcileReport:
    """model_version: the gallery's version; records of other versions are not this gallery's business."""
    record_ids = await records.all_face_ids()
    vector_ids = await gallery.all_face_ids()
    orphan_vectors = vector_ids - record_ids
    for tenant_id, face_id in sorted(orphan_vectors):
        await gallery.delete(tenant_id, [face_id])
    removed = in_grace = other_version = 0
    now = time.time()
    for tenant_id, face_id in sorted(record_ids - vector_ids):
        record = await records.get(tenant_id, face_id)
        if record is None:
            continue
        if model_version is not None and record.model_version != model_version:
            other_version += 1
            continue
        if now - record.created_at < grace_s:
            in_grace += 1
            continue
        await records.delete(tenant_id, face_id)
        if blobs is not None:
            await blobs.delete(record.proof_key)
        removed += 1
    blobs_removed = 0
    if blobs is not None and transactions is not None and orphan_grace_s is not None:
        # Queue first, records second: a transaction acknowledged in between wrote its record before its
        # acknowledgement, so its upload is found on one side or the other.
        keep = await transactions.image_keys_in_flight()
        keep |= await _proof_keys(records)
        blobs_removed = await blobs.sweep(keep, orphan_grace_s)
    return ReconcileReport(
        records=len(record_ids),
        vectors=len(vector_ids),
        vectors_removed=len(orphan_vectors),
        records_removed=removed,
        records_in_grace=in_grace,
        blobs_removed=blobs_removed,
        records_other_version=other_version,
    )


async def _proof_keys(records: FaceRecordStore) -> set[str]:
    by_tenant: defaultdict[str, list[str]] = defaultdict(list)
    for tenant_id, face_id in await records.all_face_ids():
        by_tenant[tenant_id].append(face_id)
    keys: set[str] = set()
    for tenant_id, face_ids in by_tenant.items():
        for start in range(0, len(face_ids), _RECORD_BATCH):
            found = await records.get_many(tenant_id, face_ids[start : start + _RECORD_BATCH])
            keys.update(record.proof_key for record in found.values())
    return keys

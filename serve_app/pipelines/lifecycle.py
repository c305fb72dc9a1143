"""How a face enters and leaves the gallery, written once: enrolment, removal, re-indexing, and the lock
they serialise on. Processing, gallery management, re-indexing and reconciliation all go through here.

The lock. Every writer and remover of a face holds its lock (FaceRecordStore.reference_lock on
FaceRecord.lock_subject: its client_reference, or the face itself), except the enrolment of a face without
a client_reference, whose only writer is its own transaction. The lock is renewed in the background while
its holder works, so a holder slowed by Milvus calls or an index switch keeps it; it is given up after
LockPolicy.max_hold_s of renewals. A holder that is paused (a stalled process, a stopped VM) stops renewing
and loses the lock ttl_s later; if another holder takes it meanwhile, the paused one can no longer write:

- the Redis record is the commit point of every operation, and its writes (put, delete, the erasure
  tombstone) carry the lock's token, checked by Redis atomically with the write: a holder whose lock was
  taken writes nothing there, whatever it believes;
- Milvus cannot check a token, so each Milvus write is preceded by HeldLock.check, which fails once the
  lock was found taken or its ttl passed since the last renewal. A holder paused between that check and
  its Milvus write can still write one vector late. The orders below make that harmless: an enrolment
  writes the record first, so a late vector without its record never matches (searches join records) and
  reconciliation deletes it under the lock after its grace period; a removal deletes the vector first, and
  the record's fenced delete that follows fails, so the caller's retry (or reconciliation, for a record
  left without its vector) finishes the removal.

The orders. Enrolment: record, then vector (a vector is never searchable without its record). Removal:
vector (every model version's), then record, then the proof image (the face stops matching first, and a
proof is never deleted while a record still names it). Re-indexing: vector of the current version, then
the record naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

import numpy as np

from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.stores.interfaces import BlobStore, FaceRecordStore, GalleryStore, HeldLock, LockPolicy


def _check(lock: HeldLock | None) -> None:
    if lock is not None:
        lock.check()


class FaceLifecycle:
    def __init__(
        self, records: FaceRecordStore, gallery: GalleryStore, blobs: BlobStore, lock_policy: LockPolicy
    ) -> None:
        self._records = records
        self._gallery = gallery
        self._blobs = blobs
        self._lock_policy = lock_policy

    def locked(self, tenant_id: str, subject: str) -> AbstractAsyncContextManager[HeldLock]:
        """The lock of a face's subject (FaceRecord.lock_subject, or a client_reference): every write below
        that passes the HeldLock it yields is refused once another holder has it. Waiting for it longer
        than LockPolicy.wait_s raises LockUnavailable."""
        return self._records.reference_lock(tenant_id, subject, self._lock_policy)

    async def enrol(self, record: FaceRecord, embedding: np.ndarray, lock: HeldLock | None) -> None:
        """Record first (the commit point), vector second. `lock`: the record's subject's, held; None only
        for a face without a client_reference, enrolled by its own transaction."""
        await self._records.put(record, lock)
        _check(lock)
        await self._gallery.add(
            [
                GalleryEntry(
                    face_id=record.face_id,
                    tenant_id=record.tenant_id,
                    model_version=record.model_version,
                    embedding=embedding,
                    created_at=record.created_at,
                )
            ]
        )

    async def remove(self, records: Sequence[FaceRecord], lock: HeldLock | None) -> None:
        """Remove faces of one tenant (the removal order above), under their subject's lock."""
        if not records:
            return
        tenant_id = records[0].tenant_id
        _check(lock)
        await self._gallery.delete(tenant_id, [record.face_id for record in records])
        for record in records:
            await self._records.delete(tenant_id, record.face_id, lock)
            await self._blobs.delete(record.proof_key)

    async def remove_by_id(
        self, tenant_id: str, face_id: str, proof_key: str | None, lock: HeldLock | None
    ) -> None:
        """Remove a face known by its id, whose record may be gone already (debris of an interrupted
        enrolment or removal), in the same order; every step is a no-op when there is nothing to remove."""
        _check(lock)
        await self._gallery.delete(tenant_id, [face_id])
        await self._records.delete(tenant_id, face_id, lock)
        if proof_key is not None:
            await self._blobs.delete(proof_key)

    async def is_stored(self, tenant_id: str, face_id: str) -> bool:
        """Whether anything of the face is stored: its record, or a vector of any model version."""
        if await self._records.get(tenant_id, face_id) is not None:
            return True
        return bool(await self._gallery.present(tenant_id, [face_id], all_versions=True))

    async def reindex(self, record: FaceRecord, entry: GalleryEntry, lock: HeldLock) -> None:
        """Re-point a face at a vector of entry's model version: the vector, then the record naming it."""
        _check(lock)
        await self._gallery.add([entry])
        await self._records.put(record, lock)

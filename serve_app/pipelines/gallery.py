"""Gallery management per tenant (an extension beyond the vendor interface): list the enrolled faces,
delete one, erase every face of a client_reference, statistics, and the audit trail of removals.

Removals go through FaceLifecycle (pipelines/lifecycle.py), which owns their order and the lock. Removals
of a client_reference's faces hold that reference's lock, which every enrolment under a reference takes
too, so an erasure racing an enrolment of the same reference either removes the new face or runs before it
was written, and never leaves a vector or proof without its record. An erasure leaves a tombstone (the time it
ran, under a hash of the reference): a transaction accepted before it never enrols the reference
afterwards, and results read after it no longer name the reference (TransactionService.readable).
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve_app.domain.errors import NotFound, ValidationFailed
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import MAX_PAGE_SIZE, AuditAction, AuditEntry, GalleryCounts
from serve_app.domain.identifiers import is_face_id
from serve_app.domain.keys import AUDIT_SUBJECTS, PurposeKeys, as_purpose_keys, subject_hash
from serve_app.pipelines.lifecycle import FaceLifecycle
from serve_app.stores.interfaces import AuditLog, BlobStore, FaceRecordStore, GalleryStore, LockPolicy

_FACE_CURSOR = "face:"
_AUDIT_CURSOR = "audit:"


@dataclass(frozen=True)
class FacePage:
    faces: list[FaceRecord]
    next_cursor: str | None


@dataclass(frozen=True)
class AuditPage:
    entries: list[AuditEntry]
    next_cursor: str | None


@dataclass(frozen=True)
class Erasure:
    client_reference: str
    faces_erased: int
    erased_at: float


@dataclass(frozen=True)
class GalleryStats:
    counts: GalleryCounts
    model_version: str


def _encode_cursor(kind: str, value: str) -> str:
    return base64.urlsafe_b64encode(f"{kind}{value}".encode()).decode().rstrip("=")


def _decode_cursor(kind: str, cursor: str) -> str:
    """The value inside a cursor this service issued; ValidationFailed for anything else."""
    try:
        if len(cursor) > 200:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (ValueError, binascii.Error):
        raw = ""
    if not raw.startswith(kind):
        raise ValidationFailed("cursor is not a cursor this endpoint returned.", {"cursor": "invalid"})
    return raw[len(kind) :]


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValidationFailed(
            f"limit must be between 1 and {MAX_PAGE_SIZE}.", {"limit": f"must be 1 to {MAX_PAGE_SIZE}"}
        )
    return limit


class GalleryService:
    def __init__(
        self,
        records: FaceRecordStore,
        gallery: GalleryStore,
        blobs: BlobStore,
        audit: AuditLog,
        *,
        subject_key: PurposeKeys | bytes,
        model_version: str,
        lock: LockPolicy,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """subject_key: the key ring's audit keys the trail's subject hashes are keyed with (a bare key: kid
        0), so a trail that leaks does not let anyone confirm a guessed client_reference."""
        self._records = records
        self._faces = FaceLifecycle(records, gallery, blobs, lock)
        self._audit = audit
        self._subject_keys = as_purpose_keys(AUDIT_SUBJECTS, subject_key)
        self._model_version = model_version
        self._clock = clock

    def subject_hash(self, kind: str, value: str) -> str:
        """The audit trail's name for a client_reference or face id: HMAC-SHA256 under the current audit
        key, with its kid. An operator with the keys can recompute it (domain.keys.subject_hashes) to answer
        'was this reference erased?'."""
        return subject_hash(self._subject_keys, kind, value)

    async def list_faces(
        self, tenant_id: str, client_reference: str | None, cursor: str | None, limit: int
    ) -> FacePage:
        check_limit(limit)
        after = _decode_cursor(_FACE_CURSOR, cursor) if cursor is not None else None
        if after is not None and not is_face_id(after):
            raise ValidationFailed("cursor is not a cursor this endpoint returned.", {"cursor": "invalid"})
        if client_reference is None:
            faces, last = await self._records.page(tenant_id, after, limit)
        else:
            # One reference has few faces: read them all and page in memory, in the same face id order.
            every = await self._records.records_for_reference(tenant_id, client_reference)
            remaining = [record for record in every if after is None or record.face_id > after]
            faces = remaining[:limit]
            last = faces[-1].face_id if len(remaining) > limit else None
        return FacePage(faces, _encode_cursor(_FACE_CURSOR, last) if last is not None else None)

    async def delete_face(self, tenant_id: str, actor: str, face_id: str) -> None:
        if not is_face_id(face_id):
            raise ValidationFailed(
                "face_id is not a valid face id.", {"face_id": "must be f followed by 32 hex digits"}
            )
        record = await self._records.get(tenant_id, face_id)
        if record is None:
            raise NotFound("No enrolled face has this face_id.")
        # Under the lock a re-index of the face takes too (and, for a face with a client_reference, every
        # enrolment and erasure of it), so none of them writes the face back after it was removed.
        async with self._faces.locked(tenant_id, record.lock_subject) as lock:
            # Re-read under the lock: an erasure may have removed it meanwhile.
            current = await self._records.get(tenant_id, face_id)
            if current is None:
                raise NotFound("No enrolled face has this face_id.")
            # The entry before the removal (see erase_reference).
            await self._audit.append(
                tenant_id,
                AuditEntry(
                    at=self._clock(),
                    actor=actor,
                    action=AuditAction.DELETE_FACE,
                    faces=1,
                    subject=self.subject_hash("face", face_id),
                ),
            )
            await self._faces.remove([current], lock)

    async def erase_reference(self, tenant_id: str, actor: str, client_reference: str) -> Erasure:
        """Remove every face of the reference. Idempotent: an unknown reference erases 0 faces (and is
        still audited: the request was honoured)."""
        async with self._faces.locked(tenant_id, client_reference) as lock:
            # The tombstone first, under the lock every enrolment of the reference takes: a transaction
            # accepted before this moment but processed later finds it and does not enrol the reference
            # again (TransactionProcessor._enroll), and results read later stop naming it.
            erased_at = self._clock()
            await self._records.mark_erased(tenant_id, client_reference, erased_at, lock)
            records = await self._records.records_for_reference(tenant_id, client_reference)
            # The audit entry is written before the faces are removed: a removal that happened always has
            # its entry, even if this process dies or a store fails right after it. One that failed midway
            # has an entry too, and the caller's retry, which finishes it, adds another.
            await self._audit.append(
                tenant_id,
                AuditEntry(
                    at=erased_at,
                    actor=actor,
                    action=AuditAction.ERASE_REFERENCE,
                    faces=len(records),
                    subject=self.subject_hash("reference", client_reference),
                ),
            )
            await self._faces.remove(records, lock)
        return Erasure(client_reference, len(records), erased_at)

    async def stats(self, tenant_id: str) -> GalleryStats:
        return GalleryStats(await self._records.counts(tenant_id), self._model_version)

    async def audit(self, tenant_id: str, cursor: str | None, limit: int) -> AuditPage:
        check_limit(limit)
        before = _decode_cursor(_AUDIT_CURSOR, cursor) if cursor is not None else None
        try:
            entries, last = await self._audit.page(tenant_id, before, limit)
        except ValueError:
            raise ValidationFailed(
                "cursor is not a cursor this endpoint returned.", {"cursor": "invalid"}
            ) from None
        return AuditPage(entries, _encode_cursor(_AUDIT_CURSOR, last) if last is not None else None)

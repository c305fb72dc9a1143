"""Finalising one transaction: analyse the stored image, search the tenant's gallery, enrol, record the
result.

Every step is idempotent so a transaction reclaimed after a worker died can simply be processed again:
the enrolled face id is derived from the reference id, writes are upserts, and a final state is never
overwritten.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from models.age_policy import subject_age
from models.analyzer import largest_face
from models.scoring import distance_from_score, score_from_distance
from models.types import AnalyzedFace
from serve_app.domain.errors import ServiceError
from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.domain.transactions import Transaction, TransactionKind
from serve_app.imaging.decode import decode_image
from serve_app.pipelines.analysis import FaceAnalysisBackend
from serve_app.stores.interfaces import BlobStore, FaceRecordStore, GalleryStore, TransactionStore

logger = logging.getLogger(__name__)


class ImageUnusable(ServiceError):
    """The stored image cannot be processed; the transaction fails instead of being retried."""


@dataclass(frozen=True)
class ProcessingPolicy:
    model_version: str
    max_matches: int
    min_score: float
    max_image_pixels: int
    analysis_max_side: int
    override_lock_timeout_s: float = 30.0


def enrolled_face_id(reference_id: str) -> str:
    return f"f{reference_id}"


class TransactionProcessor:
    def __init__(
        self,
        transactions: TransactionStore,
        records: FaceRecordStore,
        gallery: GalleryStore,
        blobs: BlobStore,
        analysis: FaceAnalysisBackend,
        policy: ProcessingPolicy,
    ) -> None:
        self._transactions = transactions
        self._records = records
        self._gallery = gallery
        self._blobs = blobs
        self._analysis = analysis
        self._policy = policy
        self._max_distance = distance_from_score(policy.min_score)

    async def process(self, reference_id: str) -> None:
        """Bring one transaction to a final state. Raises on backend failures so the entry stays queued."""
        tx = await self._transactions.mark_processing(reference_id)
        if tx is None:
            return  # unknown or already final: a duplicate delivery
        try:
            image = await self._load_image(tx)
        except ImageUnusable as error:
            await self._transactions.fail(reference_id, error.message)
            await self._blobs.delete(tx.image_key)  # a failed transaction's upload is never used again
            return
        if tx.kind is TransactionKind.FACE_SEARCH:
            result = await self._face_search(tx, image)
        else:
            result = await self._age_estimation(tx, image)
        await self._transactions.complete(reference_id, result)
        if not tx.enroll_face or not result.get("_enrolled"):
            await self._blobs.delete(tx.image_key)  # nothing refers to the upload any more

    async def give_up(self, reference_id: str, message: str) -> None:
        """Fail a transaction that cannot be processed, and drop its upload unless it became a proof."""
        await self._transactions.fail(reference_id, message)
        tx = await self._transactions.get(reference_id)
        if tx is not None and await self._records.get(tx.tenant_id, enrolled_face_id(reference_id)) is None:
            await self._blobs.delete(tx.image_key)

    async def _load_image(self, tx: Transaction) -> Any:
        stored = await self._blobs.get(tx.image_key)
        if stored is None:
            raise ImageUnusable("The uploaded image is no longer available.")
        data, _ = stored
        try:
            decoded = await asyncio.to_thread(
                decode_image, data, self._policy.max_image_pixels, self._policy.analysis_max_side
            )
        except ServiceError as error:
            raise ImageUnusable(error.message) from error
        return decoded.pixels

    async def _face_search(self, tx: Transaction, image: Any) -> dict[str, Any]:
        faces = await self._analysis.analyze(image, embed=True, estimate_age=False)
        probe = largest_face(faces)
        if probe is None or probe.embedding is None:
            return {"is_face_found": False, "matched_faces": [], "_enrolled": False}
        own_face_id = enrolled_face_id(tx.reference_id)
        # Search before enrolling so the probe never matches itself; a retried transaction may find its own
        # face from the earlier attempt, which is filtered out too.
        matches = await self._gallery.search(
            tx.tenant_id, probe.embedding, self._policy.max_matches + 1, self._max_distance
        )
        # client_reference is kept only in the face records (see milvus_gallery); a vector whose record is
        # gone is debris of an interrupted removal, never a match.
        records = await self._records.get_many(tx.tenant_id, [match.face_id for match in matches])
        matched = [
            [
                match.face_id,
                round(score_from_distance(match.distance), 6),
                records[match.face_id].client_reference or "",
            ]
            for match in matches
            if match.face_id != own_face_id and match.face_id in records
        ][: self._policy.max_matches]
        enrolled = False
        if tx.enroll_face:
            enrolled = await self._enroll(tx, probe)
        return {"is_face_found": True, "matched_faces": matched, "_enrolled": enrolled}

    async def _age_estimation(self, tx: Transaction, image: Any) -> dict[str, Any]:
        faces = await self._analysis.analyze(image, embed=tx.enroll_face, estimate_age=True)
        subject = largest_face(faces)
        # The flags follow the safety rules of models.age_policy (several comparable faces, quality gate).
        age = subject_age(faces)
        if subject is None or age is None:
            return {"age": None, "under_18": None, "under_21": None, "_enrolled": False}
        enrolled = False
        if tx.enroll_face and subject.embedding is not None:
            enrolled = await self._enroll(tx, subject)
        return {
            "age": age.age,
            "under_18": age.under_18,
            "under_21": age.under_21,
            "_enrolled": enrolled,
        }

    async def _enroll(self, tx: Transaction, face: AnalyzedFace) -> bool:
        """Enrol the face; False when an override was superseded by a later submission."""
        assert face.embedding is not None
        record = FaceRecord(
            face_id=enrolled_face_id(tx.reference_id),
            tenant_id=tx.tenant_id,
            client_reference=tx.client_reference,
            proof_key=tx.image_key,
            model_version=self._policy.model_version,
            created_at=tx.created_at,
            reference_id=tx.reference_id,
        )
        if tx.allow_override and tx.client_reference:
            # Serialise overrides of one client_reference so concurrent ones leave exactly one image.
            async with self._records.reference_lock(
                tx.tenant_id, tx.client_reference, self._policy.override_lock_timeout_s
            ):
                return await self._override(record, face)
        await self._add(record, face)
        return True

    async def _override(self, record: FaceRecord, face: AnalyzedFace) -> bool:
        assert record.client_reference is not None
        earlier_attempt = await self._records.get(record.tenant_id, record.face_id)
        if earlier_attempt is not None:
            # A retry: keep the decision the first attempt recorded.
            replaces = earlier_attempt.replaces
        else:
            latest = await self._records.latest_for_reference(record.tenant_id, record.client_reference)
            if latest is not None and latest.created_at > record.created_at:
                return False  # a later submission already replaced this reference's image
            replaces = latest.face_id if latest is not None else None
        await self._add(dataclasses.replace(record, replaces=replaces), face)
        if replaces is not None and replaces != record.face_id:
            previous = await self._records.get(record.tenant_id, replaces)
            if previous is not None:
                await self.remove(previous)
        return True

    async def _add(self, record: FaceRecord, face: AnalyzedFace) -> None:
        assert face.embedding is not None
        # Record first, vector second: a vector is never searchable without its record. A crash in between
        # leaves a record without a vector, which the retry completes or reconciliation removes.
        await self._records.put(record)
        await self._gallery.add(
            [
                GalleryEntry(
                    face_id=record.face_id,
                    tenant_id=record.tenant_id,
                    model_version=record.model_version,
                    embedding=face.embedding,
                    created_at=record.created_at,
                )
            ]
        )

    async def remove(self, record: FaceRecord) -> None:
        # An override that crashed before removing the face it replaced left that face behind; finish it.
        if record.replaces is not None:
            unfinished = await self._records.get(record.tenant_id, record.replaces)
            if unfinished is not None:
                await self.remove(unfinished)
        # Vector first so the face stops matching before its record and proof disappear.
        await self._gallery.delete(record.tenant_id, [record.face_id])
        await self._records.delete(record.tenant_id, record.face_id)
        await self._blobs.delete(record.proof_key)


def public_result(result: dict[str, Any]) -> dict[str, Any]:
    """Strip bookkeeping keys (prefixed with '_') before a result leaves the service."""
    return {key: value for key, value in result.items() if not key.startswith("_")}

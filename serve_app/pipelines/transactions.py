"""Creating transactions and reading them back for their owner."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping

from serve_app.domain.errors import NotReplicated, ValidationFailed
from serve_app.domain.idempotency import IdempotencyClaim, IdempotencyConflict, fingerprint
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.domain.transactions import (
    Transaction,
    TransactionKind,
    TransactionState,
    new_reference_id,
)
from serve_app.domain.transactions import upload_key as upload_key  # re-exported
from serve_app.imaging.decode import ImageFormat, validate_image
from serve_app.pipelines.commands import AgeEstimationCommand, FaceSearchCommand
from serve_app.stores.interfaces import BlobStore, FaceRecordStore, ResultArchive, TransactionStore


class TransactionService:
    def __init__(
        self,
        transactions: TransactionStore,
        blobs: BlobStore,
        max_image_pixels: int,
        *,
        records: FaceRecordStore | None = None,
        archive: ResultArchive | None = None,
    ) -> None:
        """records: where readable() joins the matches' client references (None: results are read as
        stored, for callers that never render them). archive: where finished transactions are read once
        they left the hot store (pipelines/result_archive.py)."""
        self._transactions = transactions
        self._blobs = blobs
        self._max_image_pixels = max_image_pixels
        self._records = records
        self._archive = archive

    async def create_face_search(
        self, command: FaceSearchCommand, idempotency_key: str | None = None
    ) -> Transaction:
        """idempotency_key: the client's Idempotency-Key (domain/idempotency.py), if it sent one."""
        return await self._create(
            command.tenant_id,
            TransactionKind.FACE_SEARCH,
            command.image,
            idempotency_key,
            enroll_face=command.enroll_face,
            allow_override=command.allow_override,
            client_reference=command.client_reference,
        )

    async def create_age_estimation(
        self, command: AgeEstimationCommand, idempotency_key: str | None = None
    ) -> Transaction:
        return await self._create(
            command.tenant_id,
            TransactionKind.AGE_ESTIMATION,
            command.image,
            idempotency_key,
            enroll_face=command.enroll_face,
        )

    async def _create(
        self,
        tenant_id: str,
        kind: TransactionKind,
        image: bytes,
        idempotency_key: str | None,
        *,
        enroll_face: bool,
        allow_override: bool = False,
        client_reference: str | None = None,
    ) -> Transaction:
        fields = {
            "enroll_face": enroll_face,
            "allow_override": allow_override,
            "client_reference": client_reference,
        }
        # Checked now, so a corrupt upload is refused with a 4xx instead of failing later in a worker; the
        # fingerprint of a keyed create is hashed in the same thread, off the event loop.
        image_format, request_fingerprint = await asyncio.to_thread(
            self._check_upload, tenant_id, kind, fields, image, idempotency_key is not None
        )
        now = time.time()
        reference_id = new_reference_id()
        tx = Transaction(
            reference_id=reference_id,
            tenant_id=tenant_id,
            kind=kind,
            state=TransactionState.QUEUED,
            created_at=now,
            updated_at=now,
            image_key=upload_key(tenant_id, reference_id),
            enroll_face=enroll_face,
            allow_override=allow_override,
            client_reference=client_reference,
        )
        claim = None
        if idempotency_key is not None and request_fingerprint is not None:
            claim = IdempotencyClaim(tenant_id, idempotency_key, request_fingerprint)
        # The image is written before the transaction exists, so a queued transaction always has its image.
        await self._blobs.put(tx.image_key, image, image_format.content_type)
        try:
            held_by = await self._transactions.create_and_enqueue(tx, claim)
        except (NotReplicated, IdempotencyConflict) as refused:
            # Refused, or a retry of a create still short of its replicas: this upload is no one's.
            if not isinstance(refused, NotReplicated) or refused.reference_id != tx.reference_id:
                await self._blobs.delete(tx.image_key)
            raise
        if held_by == tx.reference_id:
            return tx
        # A retry of a request already created: nothing new exists but this upload, which goes now (the
        # reconciler's orphan sweep would find it otherwise, an hour later).
        await self._blobs.delete(tx.image_key)
        return await self.get_for_tenant(tenant_id, held_by)

    def _check_upload(
        self, tenant_id: str, kind: TransactionKind, fields: Mapping[str, object], image: bytes, keyed: bool
    ) -> tuple[ImageFormat, str | None]:
        """The upload's format once it is known to decode (ValidationFailed and its kin otherwise), and
        the request's fingerprint when it carries an Idempotency-Key. One thread hop for both."""
        image_format = validate_image(image, self._max_image_pixels)
        return image_format, fingerprint(tenant_id, kind.value, fields, image) if keyed else None

    async def get_for_tenant(self, tenant_id: str, reference_id: str) -> Transaction:
        """The transaction if it exists and belongs to this tenant; another tenant's id is 'not valid'."""
        tx = await self._transactions.get(reference_id)
        if tx is None and self._archive is not None:
            # Redis first, the archive second: the archiver writes the archived copy before it deletes
            # the Redis one, so a transaction moving between them meanwhile is found in one of the two.
            tx = await self._archive.get(reference_id)
        if tx is None or tx.tenant_id != tenant_id:
            raise ValidationFailed(
                "reference_id does not name a transaction of yours.", {"reference_id": "unknown reference_id"}
            )
        return tx

    async def wait_final(self, tx: Transaction, timeout_s: float) -> Transaction:
        """tx as the caller just read (or created) it; its final state if reached within timeout_s."""
        if tx.state.is_final or timeout_s <= 0:
            return tx
        latest = await self._transactions.wait_final(tx.reference_id, timeout_s, seen_pending=True)
        return latest or tx

    async def readable(self, tx: Transaction) -> Transaction:
        """The transaction as its owner may read it: the client references of its matches are joined from
        the face records now (a stored result keeps face ids and scores only), so a match whose face was
        erased, deleted or replaced since is left out, and its proof image with it. The transaction's
        own client_reference is left out (read as "") when that reference was erased after the
        transaction was accepted: an erased reference is never named again, even to the client who
        submitted it."""
        if self._records is None or not tx.state.is_final:
            return tx
        client_reference = tx.client_reference
        if client_reference is not None:
            erased_at = await self._records.erased_at(tx.tenant_id, client_reference)
            if erased_at is not None and erased_at >= tx.created_at:
                client_reference = None
        result = tx.result
        if isinstance(result, FaceSearchOutcome) and result.matches:
            found = await self._records.get_many(tx.tenant_id, [match.face_id for match in result.matches])
            matches = tuple(
                dataclasses.replace(match, client_reference=found[match.face_id].client_reference or "")
                for match in result.matches
                if match.face_id in found
            )
            result = dataclasses.replace(result, matches=matches)
        return dataclasses.replace(tx, client_reference=client_reference, result=result)

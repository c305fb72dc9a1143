"""Creating transactions and reading them back for their owner."""

from __future__ import annotations

import asyncio
import time

from serve_app.domain.errors import ValidationFailed
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.imaging.decode import validate_image
from serve_app.pipelines.commands import AgeEstimationCommand, FaceSearchCommand
from serve_app.stores.interfaces import BlobStore, TransactionStore


def upload_key(tenant_id: str, reference_id: str) -> str:
    return f"uploads/{tenant_id}/{reference_id}"


class TransactionService:
    def __init__(self, transactions: TransactionStore, blobs: BlobStore, max_image_pixels: int) -> None:
        self._transactions = transactions
        self._blobs = blobs
        self._max_image_pixels = max_image_pixels

    async def create_face_search(self, command: FaceSearchCommand) -> Transaction:
        return await self._create(
            command.tenant_id,
            TransactionKind.FACE_SEARCH,
            command.image,
            enroll_face=command.enroll_face,
            allow_override=command.allow_override,
            client_reference=command.client_reference,
        )

    async def create_age_estimation(self, command: AgeEstimationCommand) -> Transaction:
        return await self._create(
            command.tenant_id, TransactionKind.AGE_ESTIMATION, command.image, enroll_face=command.enroll_face
        )

    async def _create(
        self,
        tenant_id: str,
        kind: TransactionKind,
        image: bytes,
        *,
        enroll_face: bool,
        allow_override: bool = False,
        client_reference: str | None = None,
    ) -> Transaction:
        # Check it now so a corrupt upload is refused with a 4xx instead of failing later in a worker.
        image_format = await asyncio.to_thread(validate_image, image, self._max_image_pixels)
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
        # The image is written before the transaction exists, so a queued transaction always has its image.
        await self._blobs.put(tx.image_key, image, image_format.content_type)
        await self._transactions.create_and_enqueue(tx)
        return tx

    async def get_for_tenant(self, tenant_id: str, reference_id: str) -> Transaction:
        """The transaction if it exists and belongs to this tenant; another tenant's id is 'not valid'."""
        tx = await self._transactions.get(reference_id)
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

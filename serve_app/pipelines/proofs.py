"""Serving enrolled proof images."""

from __future__ import annotations

from serve_app.domain.errors import NotFound
from serve_app.stores.interfaces import BlobStore, FaceRecordStore


class ProofService:
    def __init__(self, records: FaceRecordStore, blobs: BlobStore) -> None:
        self._records = records
        self._blobs = blobs

    async def load(self, tenant_id: str, face_id: str) -> tuple[bytes, str]:
        """(image bytes, content type) of an enrolled face of this tenant; NotFound once it was replaced."""
        record = await self._records.get(tenant_id, face_id)
        if record is None:
            raise NotFound("No proof image exists for this URL.")
        stored = await self._blobs.get(record.proof_key)
        if stored is None:
            raise NotFound("No proof image exists for this URL.")
        return stored

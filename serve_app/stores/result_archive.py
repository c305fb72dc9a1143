"""Finished transactions past Redis' hot window, kept as blobs for the rest of the retention period.

One JSON document per transaction under the key `results/<reference_id>`: its Redis hash fields
(transaction_codec), so a result reads back exactly as it read from Redis. The blob store is its own (a
directory apart from uploads and proofs, FACESEARCH_RESULTS_DIR): reconciliation's sweep of blobs no face
record or queued transaction names must never reach an archived result.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from serve_app.domain.identifiers import is_reference_id
from serve_app.domain.transactions import Transaction
from serve_app.stores.interfaces import BlobStore, SweptPage
from serve_app.stores.transaction_codec import decode_transaction, encode_transaction

_CONTENT_TYPE = "application/json"


def archive_key(reference_id: str) -> str:
    return f"results/{reference_id}"


class BlobResultArchive:
    def __init__(self, blobs: BlobStore, retention_s: int, *, clock: Callable[[], float] = time.time) -> None:
        """retention_s: a transaction is gone this long after it became final (0: kept for ever), as it
        would have expired from Redis."""
        self._blobs = blobs
        self._retention_s = retention_s
        self._clock = clock

    async def put(self, tx: Transaction) -> None:
        """Write (or overwrite with the same content) the archived copy; durable when this returns."""
        document = json.dumps(encode_transaction(tx), separators=(",", ":"), sort_keys=True)
        await self._blobs.put(archive_key(tx.reference_id), document.encode(), _CONTENT_TYPE)

    async def get(self, reference_id: str) -> Transaction | None:
        """The archived transaction; None when there is none or its retention has passed (a sweep may
        not have deleted it yet)."""
        if not is_reference_id(reference_id):
            return None
        stored = await self._blobs.get(archive_key(reference_id))
        if stored is None:
            return None
        tx = decode_transaction(reference_id, json.loads(stored[0]))
        if self._retention_s and self._clock() - tx.updated_at > self._retention_s:
            return None
        return tx

    async def sweep_page(self, after: str | None, archived_after_s: float, limit: int) -> SweptPage:
        """A copy is written archived_after_s or later after its transaction became final, so one whose
        file is older than retention - archived_after_s is due. The blob store's page, its cursor and all:
        the archive holds nothing else (its own directory)."""
        if not self._retention_s:
            return SweptPage(0, None)
        return await self._blobs.sweep_old(after, max(0.0, self._retention_s - archived_after_s), limit)

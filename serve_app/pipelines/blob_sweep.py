"""The orphaned-blob sweep, run by reconciliation under its lease (pipelines/jobs.py): uploads and proofs
older than a grace period that no face record and no unfinished transaction owns (an upload whose
transaction was never created, a file a crash left behind between two deletions).

It streams: the blob store is read a page at a time (BlobStore.scan_old), and each blob's owner is named by
its key, uploads/<tenant>/<reference_id> (domain.transactions.upload_key and upload_owner): the face that
transaction enrols (domain.identifiers.enrolled_face_id), under that tenant. One pipelined EXISTS per page
finds the owned ones; only the rest (orphans, and uploads still queued) are looked at one by one. Memory
is one page whatever the size of the gallery, and a pass interrupted between pages is resumed from its
cursor by the next holder.

Order, per blob without a record: its transaction first, the record again second. A transaction that is
not final may still enrol from the upload (or delete it itself); one that is final has written its record
before it became final, so a record still absent when read after that is absent for good. Reading the
record only once, before the transaction, could see no record, then a transaction that had just enrolled.
A key of another shape (none is written today) or a blob written before keys were recorded is kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from serve_app.domain.identifiers import enrolled_face_id
from serve_app.domain.transactions import upload_owner
from serve_app.stores.interfaces import BlobStore, FaceRecordStore, TransactionStore

logger = logging.getLogger(__name__)

_PARALLEL = 16  # concurrent transaction reads and deletions within a page


@dataclass
class SweepReport:
    removed: int = 0
    kept_unnamed: int = 0  # old blobs whose owner cannot be named (kept)


def owner_of(key: str) -> tuple[str, str, str] | None:
    """(tenant, face id, reference id) of the face an upload's key belongs to; None for another key."""
    owner = upload_owner(key)
    if owner is None:
        return None
    tenant, reference_id = owner
    return tenant, enrolled_face_id(reference_id), reference_id


class BlobSweep:
    def __init__(
        self,
        blobs: BlobStore,
        records: FaceRecordStore,
        transactions: TransactionStore,
        grace_s: float,
        page: int = 1000,
    ) -> None:
        self._blobs = blobs
        self._records = records
        self._transactions = transactions
        self._grace_s = grace_s
        self._page = page

    async def run(
        self, after: str | None, checkpoint: Callable[[str], Awaitable[None]], report: SweepReport
    ) -> None:
        """Sweep from the cursor `after` to the end; checkpoint(cursor) after every page (it renews the
        lease and raises when it was lost, which stops the sweep)."""
        while True:
            page = await self._blobs.scan_old(after, self._grace_s, self._page)
            report.kept_unnamed += page.unnamed
            report.removed += await self._sweep(page.keys)
            if page.after is None:
                return
            after = page.after
            await checkpoint(after)

    async def _sweep(self, keys: list[str]) -> int:
        owned = {key: owner for key in keys if (owner := owner_of(key)) is not None}
        if len(owned) < len(keys):
            logger.warning("blob sweep: kept %d blobs whose key names no upload", len(keys) - len(owned))
        present = await self._records.existing([(tenant, face) for tenant, face, _ in owned.values()])
        candidates = [key for key, (tenant, face, _) in owned.items() if (tenant, face) not in present]
        if not candidates:
            return 0
        limit = asyncio.Semaphore(_PARALLEL)

        async def settled(key: str) -> bool:
            """Whether the upload's transaction can no longer enrol from it."""
            async with limit:
                tx = await self._transactions.get(owned[key][2])
            return tx is None or tx.state.is_final

        finals = await asyncio.gather(*(settled(key) for key in candidates))
        unclaimed = [key for key, final in zip(candidates, finals, strict=True) if final]
        again = await self._records.existing([(owned[key][0], owned[key][1]) for key in unclaimed])
        doomed = [key for key in unclaimed if (owned[key][0], owned[key][1]) not in again]

        async def delete(key: str) -> None:
            async with limit:
                await self._blobs.delete(key)

        await asyncio.gather(*(delete(key) for key in doomed))
        return len(doomed)

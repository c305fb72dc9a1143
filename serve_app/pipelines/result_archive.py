"""Moving finished results out of Redis once their hot window has passed.

Redis holds a finished transaction for result_hot_window_s; then one worker at a time (holding a lease)
writes each one to the result archive (a blob store) and only after that write returned deletes the Redis
copy, so a result is always in one place or both, never in neither: a reader that misses it in Redis finds
it in the archive (TransactionService.get_for_tenant reads Redis first, then the archive). A pass that
dies half-way leaves copies in both, which the next pass archives again (the same content) and drops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from serve_app.stores.interfaces import FinishedTransactions, Lease, ResultArchive

logger = logging.getLogger(__name__)

_PARALLEL_WRITES = 16


@dataclass(frozen=True)
class ArchiveReport:
    archived: int  # copies written to the archive
    dropped: int  # Redis copies deleted after their archive write
    expired: int  # listed, but already gone from Redis (expired: nothing to keep)
    swept: int = 0  # archived copies deleted at the end of their retention


async def archive_finished(
    transactions: FinishedTransactions,
    archive: ResultArchive,
    hot_window_s: float,
    *,
    batch: int = 500,
    max_batches: int = 200,
) -> ArchiveReport:
    """Archive every transaction final for longer than hot_window_s (up to batch * max_batches a pass)."""
    archived = dropped = expired = 0
    for _ in range(max_batches):
        entries = await transactions.finished_before(hot_window_s, batch)
        if not entries:
            break
        due = [entry.transaction for entry in entries if entry.transaction is not None]
        expired += len(entries) - len(due)
        for start in range(0, len(due), _PARALLEL_WRITES):
            await asyncio.gather(*(archive.put(tx) for tx in due[start : start + _PARALLEL_WRITES]))
        archived += len(due)
        # Only now, with every copy written: a failed write above raised before anything was dropped.
        dropped += await transactions.drop_archived(entries)
        if len(entries) < batch:
            break
    return ArchiveReport(archived, dropped, expired)


class ResultArchiver:
    """The periodic job: one pass per call of run_once, by whichever worker holds the lease."""

    def __init__(
        self,
        transactions: FinishedTransactions,
        archive: ResultArchive,
        lease: Lease,
        hot_window_s: float,
        every_s: float,
        sweep_every_s: float = 3600.0,
    ) -> None:
        self._transactions = transactions
        self._archive = archive
        self._lease = lease
        self._hot_window_s = hot_window_s
        self._every_s = every_s
        self._sweep_every_s = sweep_every_s
        self._last_sweep = 0.0

    async def run_once(self, holder: str) -> ArchiveReport | None:
        """None when another worker holds the lease. The lease outlives a few missed passes, so a holder
        keeps it from pass to pass and a dead one's lapses within 3 periods."""
        if not await self._lease.acquire(holder, 3 * self._every_s):
            return None
        report = await archive_finished(self._transactions, self._archive, self._hot_window_s)
        now = time.monotonic()
        if now - self._last_sweep >= self._sweep_every_s or self._last_sweep == 0.0:
            self._last_sweep = now
            swept = await self._archive.sweep(self._hot_window_s)
            report = ArchiveReport(report.archived, report.dropped, report.expired, swept)
        return report

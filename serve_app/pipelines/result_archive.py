"""Moving finished results out of Redis once their hot window has passed.

Redis holds a finished transaction for result_hot_window_s; then one worker at a time (holding the
"result-archive" job's lease, pipelines/jobs.py, renewed before every batch, so a holder paused past its lease
stops at its next batch once another took over) writes each one to the result archive (a blob store) and only
after that write returned deletes the Redis copy, so a result is always in one place or both, never in
neither: a reader that misses it in Redis finds it in the archive (TransactionService.get_for_tenant reads
Redis first, then the archive). A pass that dies half-way leaves copies in both, which the next pass archives
again (the same content) and drops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from serve_app.pipelines.jobs import LeasedJob, LeaseLost
from serve_app.stores.interfaces import FinishedTransactions, JobLease, ResultArchive

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
    before_batch: Callable[[], Awaitable[None]] | None = None,
) -> ArchiveReport:
    """Archive every transaction final for longer than hot_window_s (up to batch * max_batches a pass).
    before_batch (the lease's renewal) runs before every batch; what it raises stops the pass."""
    archived = dropped = expired = 0
    for _ in range(max_batches):
        if before_batch is not None:
            await before_batch()
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
        lease: JobLease,
        hot_window_s: float,
        every_s: float,
        sweep_every_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        batch: int = 500,
    ) -> None:
        self._transactions = transactions
        self._archive = archive
        self._lease = lease
        self._hot_window_s = hot_window_s
        self._every_s = every_s
        self._sweep_every_s = sweep_every_s
        self._clock = clock
        self._batch = batch

    async def run_once(self, holder: str) -> ArchiveReport | None:
        """None when another worker holds the lease, or when it was lost during the pass (what the pass
        did is kept: every batch is safe to repeat). The lease outlives a few missed renewals, so a dead
        holder's lapses within 3 periods. The retention sweep runs at most every sweep_every_s across the
        cluster (when it last ran is a field of the job)."""
        async with LeasedJob(self._lease, holder, 3 * self._every_s).hold() as job:
            if job is None:
                return None
            try:
                report = await archive_finished(
                    self._transactions,
                    self._archive,
                    self._hot_window_s,
                    batch=self._batch,
                    before_batch=job.renew,
                )
                last = await job.read("last-sweep")
                now = self._clock()
                if last is None or now - float(last) >= self._sweep_every_s:
                    await job.checkpoint({"last-sweep": repr(now)})
                    swept = await self._archive.sweep(self._hot_window_s)
                    report = ArchiveReport(report.archived, report.dropped, report.expired, swept)
            except LeaseLost:
                logger.warning("result archive: lost its lease during a pass; another holder goes on")
                return None
            return report

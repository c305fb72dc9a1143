"""Moving finished results out of Redis once their hot window has passed, and deleting the archived copies
at the end of their retention: two leased jobs of the workers (pipelines/jobs.py).

The archive walk (ResultArchiver, the "result-archive" job): Redis holds a finished transaction for
result_hot_window_s; then one worker at a time (holding the job's lease, renewed before every batch, so a
holder paused past its lease stops at its next batch once another took over) writes each one to the result
archive (a blob store) and only after that write returned deletes the Redis copy, so a result is always in
one place or both, never in neither: a reader that misses it in Redis finds it in the archive
(TransactionService.get_for_tenant reads Redis first, then the archive). A pass that dies half-way leaves
copies in both, which the next pass archives again (the same content) and drops.

The retention sweep (ResultSweeper, the "result-sweep" job): one pass per sweep interval across the
cluster deletes the archived copies past their retention, a page of the archive at a time
(ResultArchive.sweep_page): it renews its lease and writes its cursor after every page, so its memory is one
page whatever the archive's size, a holder that lost its lease stops at its next page, and a pass whose
holder died is resumed from its cursor by the next one.
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
    """The archive walk: one pass per call of run_once, by whichever worker holds the lease."""

    def __init__(
        self,
        transactions: FinishedTransactions,
        archive: ResultArchive,
        lease: JobLease,
        hot_window_s: float,
        every_s: float,
        batch: int = 500,
    ) -> None:
        self._transactions = transactions
        self._archive = archive
        self._lease = lease
        self._hot_window_s = hot_window_s
        self._every_s = every_s
        self._batch = batch

    @property
    def lease_s(self) -> float:
        """The lease outlives a few missed renewals, so a dead holder's lapses within 3 periods."""
        return 3 * self._every_s

    async def run_once(self, holder: str) -> ArchiveReport | None:
        """None when another worker holds the lease, or when it was lost during the pass (what the pass
        did is kept: every batch is safe to repeat)."""
        async with LeasedJob(self._lease, holder, self.lease_s).hold() as job:
            if job is None:
                return None
            try:
                return await archive_finished(
                    self._transactions,
                    self._archive,
                    self._hot_window_s,
                    batch=self._batch,
                    before_batch=job.renew,
                )
            except LeaseLost:
                logger.warning("result archive: lost its lease during a pass; another holder goes on")
                return None


@dataclass(frozen=True)
class SweepReport:
    swept: int  # archived copies deleted by this pass
    resumed: bool  # went on from the cursor an earlier holder left


_CURSOR = "cursor"  # the sweep's fields: where the pass under way stopped, and when the last one ended
_LAST_PASS = "last-pass"


class ResultSweeper:
    """The retention sweep: one pass per call of run_once, by whichever worker holds the lease, at most one
    completed pass per every_s across the cluster."""

    def __init__(
        self,
        archive: ResultArchive,
        lease: JobLease,
        hot_window_s: float,
        every_s: float,
        lease_s: float,
        page: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """lease_s: outlives the longest page (a page is one directory walk and its deletions)."""
        self._archive = archive
        self._lease = lease
        self._hot_window_s = hot_window_s
        self._every_s = every_s
        self._lease_s = lease_s
        self._page = page
        self._clock = clock

    async def run_once(self, holder: str) -> SweepReport | None:
        """None when another worker holds the lease, when the last pass ended less than every_s ago (and
        none is unfinished), or when the lease was lost during the pass (its cursor is kept)."""
        async with LeasedJob(self._lease, holder, self._lease_s).hold() as job:
            if job is None:
                return None
            after = await job.read(_CURSOR)
            last = await job.read(_LAST_PASS)
            if after is None and last is not None and self._clock() - float(last) < self._every_s:
                return None
            resumed = after is not None
            swept = 0
            try:
                while True:
                    page = await self._archive.sweep_page(after, self._hot_window_s, self._page)
                    swept += page.removed
                    if page.after is None:
                        break
                    after = page.after
                    await job.checkpoint({_CURSOR: after})  # renews; LeaseLost stops the pass here
                await job.checkpoint({_CURSOR: None, _LAST_PASS: repr(self._clock())})
            except LeaseLost:
                logger.warning("result sweep: lost its lease during a pass; the next holder resumes it")
                return None
            return SweepReport(swept, resumed)

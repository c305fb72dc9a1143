"""The leased job runner: reconciliation (with its blob sweep) and the result archive run through it.

One holder at a time across the cluster holds a job's lease (JobLease). A pass renews the lease between
its batches (JobPass.renew) and before every checkpoint; a checkpoint writes the job's state (its cursor)
only while the lease is still this holder's, checked atomically with the write. So a holder that was paused
past its lease's expiry, while another took the lease and went on, stops at its next renewal and never
overwrites the new holder's cursor: two passes never go on side by side for longer than the batch the
paused one was in, and each batch's work is safe to repeat (every job's batch is idempotent).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from serve_app.domain.errors import BackendUnavailable
from serve_app.stores.interfaces import JobLease

logger = logging.getLogger(__name__)


class LeaseLost(Exception):
    """The pass's lease lapsed and another holder may have it: the pass stops here."""


class JobPass:
    """One holder's pass of a leased job."""

    def __init__(self, lease: JobLease, holder: str, ttl_s: float) -> None:
        self._lease = lease
        self._holder = holder
        self._ttl_s = ttl_s

    async def renew(self) -> None:
        """Extend the lease by its ttl; LeaseLost when another holder may have it."""
        if not await self._lease.renew(self._holder, self._ttl_s):
            raise LeaseLost

    async def read(self, field: str) -> str | None:
        return await self._lease.read(field)

    async def checkpoint(self, values: dict[str, str | None]) -> None:
        """Renew, then write the job's state fields (None deletes one), fenced by the lease."""
        await self.renew()
        if not await self._lease.write(self._holder, values):
            raise LeaseLost


class LeasedJob:
    def __init__(self, lease: JobLease, holder: str, ttl_s: float) -> None:
        """holder: this process' name on the lease; ttl_s: how long the lease outlives its last renewal
        (longer than any one batch of the job)."""
        self._lease = lease
        self._holder = holder
        self._ttl_s = ttl_s

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[JobPass | None]:
        """A pass when the lease was free (or already this holder's), else None; given back on exit."""
        if not await self._lease.acquire(self._holder, self._ttl_s):
            yield None
            return
        try:
            yield JobPass(self._lease, self._holder, self._ttl_s)
        finally:
            try:
                await self._lease.release(self._holder)
            except BackendUnavailable as error:
                logger.warning("could not give back a job's lease (it lapses on its own): %s", error.message)

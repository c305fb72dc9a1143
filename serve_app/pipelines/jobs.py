"""The leased job runner and the background loops of a worker replica.

Leased jobs: reconciliation (with its blob sweep), the result archive, the archive's retention sweep and the
gallery's index switch run through LeasedJob. One holder at a time across the cluster holds a job's lease
(JobLease). A pass renews the lease between its batches (JobPass.renew) and before every checkpoint, and
around a step that may outlast a renewal period (JobPass.kept_alive: the index switch's waits for a
write's window or an index build); a checkpoint writes the job's state (its cursor) only while the lease is
still this holder's, checked atomically with the write. So a holder that dies stops renewing and its lease
lapses within its ttl, and the next holder resumes from the cursor; a holder that was paused past its
lease's expiry, while another took the lease and went on, stops at its next renewal and never overwrites
the new holder's cursor: two passes never go on side by side for longer than the batch the paused one was
in, and each batch's work is safe to repeat (every job's batch is idempotent).

Background loops: a worker replica's loops are one registry (serve_app/wiring/worker.py, WorkerLoops: a
loop is one BackgroundLoop entry, with its lease and interval); the replica starts one task per entry and
its health check fails when any task has ended (serve_app/deployments/worker.py), so Serve replaces a
replica whose loop died. A periodic loop (run_periodically) survives a failed pass (logged; the next pass
comes at its time): only a bug in the loop itself ends it before it is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

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

    @contextlib.asynccontextmanager
    async def kept_alive(self) -> AsyncIterator[None]:
        """Renew the lease every third of its ttl in the background while the body runs, for steps that
        may outlast a renewal period (a wait for an index build). A renewal that finds the lease taken
        cancels the body, which then raises LeaseLost; one that cannot reach the store is tried again at
        the next beat (the lease lapses if the store stays away: the holder is as good as dead)."""
        body = asyncio.current_task()
        assert body is not None
        lost = False

        async def beat() -> None:
            nonlocal lost
            while True:
                await asyncio.sleep(self._ttl_s / 3)
                try:
                    await self.renew()
                except LeaseLost:
                    lost = True
                    body.cancel()
                    return
                except BackendUnavailable as error:
                    logger.warning("could not renew a job's lease (trying again): %s", error.message)

        beating = asyncio.get_running_loop().create_task(beat())
        try:
            yield
        except asyncio.CancelledError:
            if lost and body.uncancel() == 0:
                raise LeaseLost from None
            raise
        finally:
            beating.cancel()
            await asyncio.wait({beating})  # not suppressing a cancellation of the body itself
        if lost:  # the body caught the cancellation itself
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


@dataclass(frozen=True)
class BackgroundLoop:
    """One background loop of a worker replica."""

    name: str  # as logs, the health check and docs/operations.md name it
    run: Callable[[asyncio.Event], Coroutine[Any, Any, None]]  # runs until the event is set
    # The period of its passes; None: it runs continuously (claiming work as it comes).
    every_s: float | None
    # The cluster-wide JobLease its passes take (one holder at a time), by name; None: every replica runs
    # it, sharing the work through leases on the items it claims (queue entries, webhook events).
    lease: str | None
    # How long a lease of it (the job's, or each claimed item's) outlives a holder that died; None: none.
    lease_s: float | None
    enabled: bool = True  # off by configuration (the result archive without a hot window): not started


async def run_periodically(
    name: str, every_s: float, run_pass: Callable[[], Awaitable[None]], stop: asyncio.Event
) -> None:
    """A pass every every_s (the first after one period) until stop is set. A pass that fails is logged
    and the next one comes at its time: a backend outage never ends the loop."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if stop.is_set():
            return
        try:
            await run_pass()
        except Exception as error:
            logger.warning("%s failed (next pass in %.0f s): %r", name, every_s, error)

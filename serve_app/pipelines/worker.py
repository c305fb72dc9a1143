"""The queue consumer: claims transactions, processes them concurrently, acknowledges them when final.

An entry is acknowledged only after its transaction reached a final state, so a worker that dies mid-way
leaves it pending; any live worker reclaims it after `stale_after_s` and finishes it. A live worker renews
its lease on the entries it is still working on (their idle time restarts, their delivery count does not
grow), so a slow transaction is never reclaimed and processed a second time while its worker is alive.
Every worker also removes, now and then, the consumers of workers that are gone (their entries reclaimed,
untouched for many stale windows), so restarts do not make the consumer group grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve_app.domain.errors import BackendRejected, BackendUnavailable, LockUnavailable
from serve_app.pipelines.processing import TransactionProcessor
from serve_app.stores.interfaces import QueueEntry, WorkQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPolicy:
    # The operational three come from Settings.worker (their defaults live there, once).
    concurrency: int
    stale_after_s: float
    max_deliveries: int
    claim_block_ms: int = 1000
    reclaim_every_s: float = 5.0
    backoff_s: float = 1.0
    outage_backoff_s: float = 2.0
    gone_after_stale_windows: float = 10.0

    @property
    def lease_renew_every_s(self) -> float:
        # Three renewals per stale window: one late renewal still leaves the lease alive.
        return min(self.reclaim_every_s, self.stale_after_s / 3)

    @property
    def consumer_gone_after_s(self) -> float:
        """How long a consumer must have been silent (no entry handed to it, no prune call of its own)
        before it counts as gone. Well beyond the stale window, so a dead worker's entries were reclaimed
        long before, and beyond every period of the worker loop."""
        longest = max(self.stale_after_s, self.claim_block_ms / 1000, self.reclaim_every_s)
        return longest * self.gone_after_stale_windows

    @property
    def prune_every_s(self) -> float:
        # Five heartbeats per gone window: a live worker is never silent for that long, even when some
        # rounds are late.
        return self.consumer_gone_after_s / 5


class QueueWorker:
    def __init__(
        self,
        consumer: str,
        queue: WorkQueue,
        processor: TransactionProcessor,
        policy: WorkerPolicy,
        on_processed: Callable[[float], None] | None = None,
    ) -> None:
        """on_processed receives the seconds each successfully processed transaction took (metrics)."""
        self.consumer = consumer
        self._on_processed = on_processed
        self._queue = queue
        self._processor = processor
        self._policy = policy
        self._in_flight: set[asyncio.Task[None]] = set()
        self._active_entries: set[str] = set()
        self.processed = 0

    def update_policy(self, policy: WorkerPolicy) -> None:
        """Takes effect on the next claim (Serve's user_config reaches running replicas this way)."""
        self._policy = policy

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        next_reclaim = next_renewal = next_prune = 0.0
        while not stop.is_set():
            try:
                if loop.time() >= next_prune:
                    next_prune = loop.time() + self._policy.prune_every_s
                    await self._prune_gone_consumers()
                # Only with a free slot: the queue refuses a request for zero entries (Redis: COUNT 0).
                reclaim_due = loop.time() >= next_reclaim and self._free_slots() > 0
                if reclaim_due or loop.time() >= next_renewal:
                    # Also right before every reclaim, so a reclaim never finds this worker's own entries
                    # idle: self-reclaims would count deliveries towards the give-up.
                    next_renewal = loop.time() + self._policy.lease_renew_every_s
                    await self._renew_leases()
                if reclaim_due:
                    next_reclaim = loop.time() + self._policy.reclaim_every_s
                    await self._start_all(
                        await self._queue.reclaim_stale(
                            self.consumer, int(self._policy.stale_after_s * 1000), self._free_slots()
                        )
                    )
                free = self._free_slots()
                if free == 0:
                    await asyncio.sleep(0.005)
                    continue
                await self._start_all(
                    await self._queue.claim(self.consumer, free, self._policy.claim_block_ms)
                )
            except BackendUnavailable as error:
                logger.warning("worker %s: %s; retrying", self.consumer, error.message)
                await asyncio.sleep(self._policy.backoff_s)
        await self.drain()

    async def _prune_gone_consumers(self) -> None:
        """Forget the consumers of workers that are gone (restarted or scaled away), so the group does not
        grow with every restart; their entries were reclaimed first (see WorkQueue.prune_consumers)."""
        gone_after_ms = int(self._policy.consumer_gone_after_s * 1000)
        removed = await self._queue.prune_consumers(self.consumer, gone_after_ms)
        if removed:
            logger.info("worker %s: removed gone consumers %s from the queue", self.consumer, sorted(removed))

    async def _renew_leases(self) -> None:
        working_on = sorted(self._active_entries)
        if not working_on:
            return
        lost = set(working_on) - set(await self._queue.renew(self.consumer, working_on))
        if lost:
            # Another worker reclaimed them (this one stalled past stale_after_s); processing is idempotent
            # and a final state is never overwritten, so both finishing is harmless.
            logger.warning("worker %s: lost the lease on %s", self.consumer, sorted(lost))

    async def drain(self) -> None:
        # The leases are kept while the last transactions finish, or another worker would take them over.
        while self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=self._policy.lease_renew_every_s)
            with contextlib.suppress(BackendUnavailable):
                await self._renew_leases()

    def _free_slots(self) -> int:
        return max(0, self._policy.concurrency - len(self._in_flight))

    async def _start_all(self, entries: list[QueueEntry]) -> None:
        for entry in entries:
            if entry.entry_id in self._active_entries:
                continue  # reclaimed from ourselves while still being processed: don't run it twice
            self._active_entries.add(entry.entry_id)
            task = asyncio.create_task(self._handle(entry))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            task.add_done_callback(functools.partial(self._finished, entry.entry_id))

    def _finished(self, entry_id: str, _task: asyncio.Task[None]) -> None:
        self._active_entries.discard(entry_id)

    async def _handle(self, entry: QueueEntry) -> None:
        if entry.deliveries > self._policy.max_deliveries:
            # A poison entry (its attempts failed or killed their worker): fail it rather than retry forever.
            try:
                await self._processor.give_up(entry.reference_id, "The transaction could not be processed.")
                await self._queue.ack([entry.entry_id])
            except Exception:
                # Not acknowledged: reclaimed later, and the give-up (idempotent) finishes then.
                logger.exception(
                    "worker %s: giving up %s failed; will retry", self.consumer, entry.reference_id
                )
            return
        started = time.perf_counter()
        try:
            await self._processor.process(entry.reference_id)
        except BackendRejected:
            # The backend refuses this transaction's request every time: a failed attempt, not an outage.
            logger.exception(
                "worker %s: a backend rejected transaction %s; will retry", self.consumer, entry.reference_id
            )
            return
        except LockUnavailable as error:
            # Its reference's lock stayed taken (or was lost to another holder): a failed attempt, counted
            # like any other, so a reference that stays locked ends the transaction `failed` after
            # max_deliveries (give_up needs the lock only when a face of it is stored) instead of a requeue
            # with a fresh count, for ever. Not acknowledged: reclaimed after stale_after_s.
            logger.warning(
                "worker %s: transaction %s: %s; will retry", self.consumer, entry.reference_id, error.message
            )
            return
        except BackendUnavailable as error:
            # An outage is not the transaction's fault (Redis down or at its maxmemory, a full disk:
            # StorageFull): after a pause, put it back with a fresh delivery count so a long outage delays
            # transactions but never fails them. If Redis itself is down the
            # requeue fails too, and the entry stays pending until it is reclaimed.
            logger.warning(
                "worker %s: %s; transaction %s requeued", self.consumer, error.message, entry.reference_id
            )
            await asyncio.sleep(self._policy.outage_backoff_s)
            with contextlib.suppress(BackendUnavailable):
                await self._queue.requeue(entry)
            return
        except Exception:
            # Not acknowledged: it stays pending and is reclaimed and retried after stale_after_s.
            logger.exception(
                "worker %s: transaction %s failed; will retry", self.consumer, entry.reference_id
            )
            return
        self.processed += 1
        if self._on_processed is not None:
            self._on_processed(time.perf_counter() - started)
        try:
            await self._queue.ack([entry.entry_id])
        except BackendUnavailable:
            logger.warning(
                "worker %s: ack of %s failed; it will be redelivered", self.consumer, entry.entry_id
            )

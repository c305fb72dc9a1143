"""The fake WorkQueue."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serve_app.domain.errors import BackendUnavailable
from serve_app.stores.interfaces import QueueEntry
from tests.unit.fakes.common import Faults


@dataclass
class _Pending:
    reference_id: str
    consumer: str
    deliveries: int
    delivered_at: float


class FakeWorkQueue:
    """A Redis stream with one consumer group."""

    def __init__(self, faults: Faults | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._faults = faults or Faults()
        self._clock = clock
        self._ids = itertools.count(1)
        self._undelivered: deque[tuple[str, str]] = deque()
        self._pending: dict[str, _Pending] = {}
        self.acked: list[str] = []
        self.deliveries: list[QueueEntry] = []  # every hand-out, in order
        self.requeued: list[str] = []  # reference ids put back after a backend outage
        self.renewals: list[str] = []  # entry ids whose lease was renewed
        self.consumers: dict[str, float] = {}  # consumer -> when it last used the queue

    def add(self, reference_id: str) -> str:
        entry_id = f"{next(self._ids)}-0"
        self._undelivered.append((entry_id, reference_id))
        return entry_id

    async def claim(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        await self._faults.check("queue.claim")
        _positive_count(count)
        self.consumers[consumer] = self._clock()
        deadline = asyncio.get_running_loop().time() + block_ms / 1000
        # Polls like XREADGROUP BLOCK waits: entries arrive from sync add() calls, with no event to await.
        while not self._undelivered and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        entries: list[QueueEntry] = []
        while self._undelivered and len(entries) < count:
            entry_id, reference_id = self._undelivered.popleft()
            self._pending[entry_id] = _Pending(reference_id, consumer, 1, self._clock())
            entries.append(QueueEntry(entry_id, reference_id, 1))
        self.deliveries.extend(entries)
        return entries

    async def reclaim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[QueueEntry]:
        await self._faults.check("queue.reclaim_stale")
        _positive_count(count)
        now = self._clock()
        self.consumers[consumer] = now
        entries: list[QueueEntry] = []
        for entry_id, pending in sorted(self._pending.items(), key=lambda item: _id_order(item[0])):
            if len(entries) >= count:
                break
            if (now - pending.delivered_at) * 1000 >= min_idle_ms:
                pending.consumer = consumer
                pending.deliveries += 1
                pending.delivered_at = now
                entries.append(QueueEntry(entry_id, pending.reference_id, pending.deliveries))
        self.deliveries.extend(entries)
        return entries

    async def renew(self, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        await self._faults.check("queue.renew")
        self.consumers[consumer] = self._clock()
        held = []
        for entry_id in entry_ids:
            pending = self._pending.get(entry_id)
            if pending is not None and pending.consumer == consumer:
                pending.delivered_at = self._clock()
                held.append(entry_id)
        self.renewals.extend(held)
        return held

    async def prune_consumers(self, consumer: str, gone_after_ms: int) -> list[str]:
        await self._faults.check("queue.prune_consumers")
        self.consumers[consumer] = self._clock()  # the caller is alive
        holding = {pending.consumer for pending in self._pending.values()}
        gone = [
            name
            for name, seen in self.consumers.items()
            if name != consumer and name not in holding and (self._clock() - seen) * 1000 >= gone_after_ms
        ]
        for name in gone:
            del self.consumers[name]
        return gone

    async def requeue(self, entry: QueueEntry) -> None:
        await self._faults.check("queue.requeue")
        if self._pending.pop(entry.entry_id, None) is not None:
            self._undelivered.append((f"{next(self._ids)}-0", entry.reference_id))
            self.requeued.append(entry.reference_id)

    async def ack(self, entry_ids: Sequence[str]) -> None:
        await self._faults.check("queue.ack")
        for entry_id in entry_ids:
            if self._pending.pop(entry_id, None) is not None:
                self.acked.append(entry_id)

    async def depth(self) -> int:
        await self._faults.check("queue.depth")
        return len(self._undelivered) + len(self._pending)

    @property
    def pending(self) -> dict[str, int]:
        """entry_id -> delivery count of entries delivered and not acknowledged."""
        return {entry_id: pending.deliveries for entry_id, pending in self._pending.items()}

    def reference_ids(self) -> set[str]:
        """Reference ids of every entry not yet acknowledged."""
        return {ref for _entry_id, ref in self._undelivered} | {
            p.reference_id for p in self._pending.values()
        }

    @property
    def undelivered(self) -> int:
        return len(self._undelivered)


def _positive_count(count: int) -> None:
    """Redis refuses XREADGROUP/XAUTOCLAIM with COUNT 0 ("ERR COUNT must be > 0"); the store reports it as
    BackendUnavailable, so the fake does too."""
    if count < 1:
        raise BackendUnavailable(f"ERR COUNT must be > 0 (got {count})")


def _id_order(entry_id: str) -> tuple[int, int]:
    first, _, second = entry_id.partition("-")
    return int(first), int(second or 0)

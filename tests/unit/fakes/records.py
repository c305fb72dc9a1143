"""The fake FaceRecordStore."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import GalleryCounts
from tests.unit.fakes.common import Faults, _encodable


class FakeFaceRecordStore:
    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self._items: dict[tuple[str, str], FaceRecord] = {}
        self._locks: dict[tuple[str, str], tuple[object, float]] = {}  # key -> (holder, expires at)
        self.lock_holders: dict[tuple[str, str], int] = {}
        self.max_lock_holders = 0
        self.lock_acquisitions: list[tuple[str, str]] = []
        self._tenants: set[str] = set()  # as in Redis: a tenant stays listed after its last face goes
        self._erased: dict[tuple[str, str], float] = {}

    async def mark_erased(self, tenant_id: str, client_reference: str, erased_at: float) -> None:
        await self._faults.check("records.mark_erased")
        self._erased[(tenant_id, client_reference)] = erased_at

    async def erased_at(self, tenant_id: str, client_reference: str) -> float | None:
        await self._faults.check("records.erased_at")
        return self._erased.get((tenant_id, client_reference))

    async def put(self, record: FaceRecord) -> None:
        await self._faults.check("records.put")
        _encodable(record.tenant_id, record.face_id, record.client_reference, record.proof_key)
        self._tenants.add(record.tenant_id)
        self._items[(record.tenant_id, record.face_id)] = record

    async def count(self, tenant_id: str) -> int:
        await self._faults.check("records.count")
        return sum(1 for tenant, _ in self._items if tenant == tenant_id)

    async def get(self, tenant_id: str, face_id: str) -> FaceRecord | None:
        await self._faults.check("records.get")
        _encodable(tenant_id, face_id)
        return self._items.get((tenant_id, face_id))

    async def get_many(self, tenant_id: str, face_ids: Sequence[str]) -> dict[str, FaceRecord]:
        await self._faults.check("records.get_many")
        return {
            face_id: self._items[(tenant_id, face_id)]
            for face_id in face_ids
            if (tenant_id, face_id) in self._items
        }

    async def latest_for_reference(self, tenant_id: str, client_reference: str) -> FaceRecord | None:
        await self._faults.check("records.latest_for_reference")
        candidates = [
            (record.created_at, record.face_id, record)
            for record in self._items.values()
            if record.tenant_id == tenant_id and record.client_reference == client_reference
        ]
        return max(candidates, key=lambda item: item[:2])[2] if candidates else None

    async def delete(self, tenant_id: str, face_id: str) -> None:
        await self._faults.check("records.delete")
        self._items.pop((tenant_id, face_id), None)

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        await self._faults.check("records.all_face_ids")
        return {key for key in self._items if tenant_id is None or key[0] == tenant_id}

    async def tenant_ids(self) -> list[str]:
        await self._faults.check("records.tenant_ids")
        return sorted(self._tenants)

    def reference_lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> Any:
        return self._lock(tenant_id, client_reference, timeout_s)

    @contextlib.asynccontextmanager
    async def _lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> AsyncIterator[None]:
        # Like the Redis lock: waiting gives up after timeout_s, and a holder keeps the lock at most
        # timeout_s (it expires, so a dead holder cannot block the reference forever).
        key = (tenant_id, client_reference)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (held := self._locks.get(key)) is not None and held[1] > loop.time():
            if loop.time() >= deadline:
                raise BackendUnavailable(f"lock on {client_reference!r} not acquired in {timeout_s}s")
            # Polls like a blocking Redis lock does.
            await asyncio.sleep(min(0.002, max(0.0, held[1] - loop.time())))
        token = object()
        self._locks[key] = (token, loop.time() + timeout_s)
        self.lock_acquisitions.append(key)
        self.lock_holders[key] = self.lock_holders.get(key, 0) + 1
        self.max_lock_holders = max(self.max_lock_holders, self.lock_holders[key])
        try:
            yield
        finally:
            self.lock_holders[key] -= 1
            if (held := self._locks.get(key)) is not None and held[0] is token:
                del self._locks[key]  # released by its holder; an expired one is not taken from another

    async def page(
        self, tenant_id: str, after: str | None, limit: int
    ) -> tuple[list[FaceRecord], str | None]:
        await self._faults.check("records.page")
        ordered = sorted(face_id for tenant, face_id in self._items if tenant == tenant_id)
        chosen = [face_id for face_id in ordered if after is None or face_id > after][:limit]
        next_cursor = chosen[-1] if len(chosen) == limit else None
        return [self._items[(tenant_id, face_id)] for face_id in chosen], next_cursor

    async def records_for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        await self._faults.check("records.records_for_reference")
        return sorted(self.for_reference(tenant_id, client_reference), key=lambda record: record.face_id)

    async def counts(self, tenant_id: str) -> GalleryCounts:
        await self._faults.check("records.counts")
        records = self.records(tenant_id)
        times = [record.created_at for record in records]
        return GalleryCounts(
            faces=len(records),
            client_references=len({r.client_reference for r in records if r.client_reference is not None}),
            oldest_enrolment=min(times) if times else None,
            newest_enrolment=max(times) if times else None,
        )

    # Test helpers.
    def records(self, tenant_id: str | None = None) -> list[FaceRecord]:
        return [record for key, record in self._items.items() if tenant_id is None or key[0] == tenant_id]

    def for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        return [record for record in self.records(tenant_id) if record.client_reference == client_reference]


class NonExclusiveRecordStore(FakeFaceRecordStore):
    """A record store whose reference lock excludes nothing: shows what the lock protects against."""

    def reference_lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> Any:
        return contextlib.nullcontext()

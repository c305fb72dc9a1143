"""The fake FaceRecordStore."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager

from serve_app.domain.errors import LockUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import GalleryCounts
from serve_app.stores.interfaces import HeldLock, LockPolicy
from tests.unit.fakes.common import Faults, _encodable


class FakeHeldLock:
    def __init__(self, store: FakeFaceRecordStore, key: tuple[str, str], token: object) -> None:
        self._store = store
        self.key = key
        self.token = token

    def check(self) -> None:
        if not self._store.holds(self):
            raise LockUnavailable("The lock of a client_reference was lost")


class FakeFaceRecordStore:
    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self._items: dict[tuple[str, str], FaceRecord] = {}
        self._locks: dict[tuple[str, str], tuple[object, float]] = {}  # key -> (token, expires at)
        self.lock_holders: dict[tuple[str, str], int] = {}
        self.max_lock_holders = 0
        self.lock_acquisitions: list[tuple[str, str]] = []
        self._tenants: set[str] = set()  # as in Redis: a tenant stays listed after its last face goes
        self._erased: dict[tuple[str, str], float] = {}

    def holds(self, lock: HeldLock | None) -> bool:
        """Whether `lock` (None: no lock, always true) is still its holder's: the fence of the writes."""
        if lock is None:
            return True
        assert isinstance(lock, FakeHeldLock)
        held = self._locks.get(lock.key)
        return held is not None and held[0] is lock.token and held[1] > asyncio.get_running_loop().time()

    def _fence(self, lock: HeldLock | None) -> None:
        if not self.holds(lock):
            raise LockUnavailable("The lock of a client_reference was lost before a write")

    async def mark_erased(
        self, tenant_id: str, client_reference: str, erased_at: float, lock: HeldLock | None = None
    ) -> None:
        await self._faults.check("records.mark_erased")
        self._fence(lock)
        self._erased[(tenant_id, client_reference)] = erased_at

    async def erased_at(self, tenant_id: str, client_reference: str) -> float | None:
        await self._faults.check("records.erased_at")
        return self._erased.get((tenant_id, client_reference))

    async def put(self, record: FaceRecord, lock: HeldLock | None = None) -> None:
        await self._faults.check("records.put")
        _encodable(record.tenant_id, record.face_id, record.client_reference, record.proof_key)
        self._fence(lock)
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

    async def delete(self, tenant_id: str, face_id: str, lock: HeldLock | None = None) -> None:
        await self._faults.check("records.delete")
        self._fence(lock)
        self._items.pop((tenant_id, face_id), None)

    async def existing(self, faces: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        await self._faults.check("records.existing")
        return {face for face in faces if face in self._items}

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        await self._faults.check("records.all_face_ids")
        return {key for key in self._items if tenant_id is None or key[0] == tenant_id}

    async def tenant_ids(self) -> list[str]:
        await self._faults.check("records.tenant_ids")
        return sorted(self._tenants)

    def reference_lock(
        self, tenant_id: str, client_reference: str, policy: LockPolicy
    ) -> AbstractAsyncContextManager[HeldLock]:
        return self._lock(tenant_id, client_reference, policy)

    @contextlib.asynccontextmanager
    async def _lock(
        self, tenant_id: str, client_reference: str, policy: LockPolicy
    ) -> AsyncIterator[HeldLock]:
        # Like the Redis lock: waiting gives up after wait_s; a holder renews it while inside, for at most
        # max_hold_s, and it lapses ttl_s after the last renewal (here: computed, not renewed).
        key = (tenant_id, client_reference)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.wait_s
        while (held := self._locks.get(key)) is not None and held[1] > loop.time():
            if loop.time() >= deadline:
                raise LockUnavailable(f"lock on {client_reference!r} not acquired in {policy.wait_s}s")
            # Polls like a blocking Redis lock does.
            await asyncio.sleep(min(0.002, max(0.0, held[1] - loop.time())))
        token = object()
        self._locks[key] = (token, loop.time() + policy.max_hold_s + policy.ttl_s)
        self.lock_acquisitions.append(key)
        self.lock_holders[key] = self.lock_holders.get(key, 0) + 1
        self.max_lock_holders = max(self.max_lock_holders, self.lock_holders[key])
        try:
            yield FakeHeldLock(self, key, token)
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

    def reference_lock(
        self, tenant_id: str, client_reference: str, policy: LockPolicy
    ) -> AbstractAsyncContextManager[HeldLock]:
        return contextlib.nullcontext(_NoLock())

    def holds(self, lock: HeldLock | None) -> bool:
        return True


class _NoLock:
    def check(self) -> None:
        return None

"""Metadata of enrolled faces in Redis.

Keys (prefix default "fs:"):
  {p}face:{tenant}:{face_id}   JSON of the FaceRecord
  {p}faces:{tenant}            set of the tenant's face ids (all_face_ids, reconciliation)
  {p}tenants                   set of tenants that have had faces
  {p}ref:{tenant}:{sha256(client_reference)}   sorted set face_id -> created_at (latest_for_reference)
  {p}lock:ref:{tenant}:{sha256(client_reference)}   the lock of enrolments, overrides and erasures
  {p}faces-by-id:{tenant}      sorted set, all scores 0: face ids in lexical order (gallery listing pages)
  {p}faces-by-time:{tenant}    sorted set face_id -> created_at (oldest / newest enrolment)
  {p}refs:{tenant}             set of sha256(client_reference) that have faces (distinct references)
  {p}erased:{tenant}:{sha256(client_reference)}   when the reference was last erased (a tombstone that
                               expires with the transactions that could still name it)
  {p}gallery-indexed:{tenant}  marks that the three indexes above were built for faces enrolled before
                               they existed (done once, on the first listing or statistics call)

client_reference is user input of any length and content, so it only appears in key names hashed. tenant
is an issued client id and face_id one the service derived ("f" + reference_id) or signed into a proof
token, so neither contains a ":" that could reach into another tenant's keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import Any

from redis import exceptions as redis_exceptions
from redis.asyncio import Redis

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import GalleryCounts
from serve_app.stores.redis_support import redis_errors, text

logger = logging.getLogger(__name__)


def _reference_hash(client_reference: str) -> str:
    return hashlib.sha256(client_reference.encode()).hexdigest()


# Removes a record and its index entries atomically; the reference leaves the distinct-reference set only
# when its last face goes, which a MULTI cannot decide. KEYS: face, faces, by-id, by-time, refs, ref (or
# the face key again when the record had no reference). ARGV: face_id, reference hash ("" for none).
_DELETE_SCRIPT = """
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if ARGV[2] ~= '' then
  redis.call('ZREM', KEYS[6], ARGV[1])
  if redis.call('ZCARD', KEYS[6]) == 0 then
    redis.call('SREM', KEYS[5], ARGV[2])
  end
end
return 1
"""


class RedisFaceRecordStore:
    def __init__(self, redis: Redis, prefix: str = "fs:", *, erasure_ttl_s: int | None = None) -> None:
        """erasure_ttl_s: how long an erasure's tombstone is kept (None: for ever). It must outlive every
        transaction created before the erasure (see erased_at)."""
        self._redis = redis
        self._prefix = prefix
        self._erasure_ttl_s = erasure_ttl_s

    def _face_key(self, tenant_id: str, face_id: str) -> str:
        return f"{self._prefix}face:{tenant_id}:{face_id}"

    def _faces_key(self, tenant_id: str) -> str:
        return f"{self._prefix}faces:{tenant_id}"

    def _ref_key(self, tenant_id: str, client_reference: str) -> str:
        return f"{self._prefix}ref:{tenant_id}:{_reference_hash(client_reference)}"

    def _by_id_key(self, tenant_id: str) -> str:
        return f"{self._prefix}faces-by-id:{tenant_id}"

    def _by_time_key(self, tenant_id: str) -> str:
        return f"{self._prefix}faces-by-time:{tenant_id}"

    def _refs_key(self, tenant_id: str) -> str:
        return f"{self._prefix}refs:{tenant_id}"

    async def put(self, record: FaceRecord) -> None:
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._face_key(record.tenant_id, record.face_id), json.dumps(asdict(record)))
            pipe.sadd(self._faces_key(record.tenant_id), record.face_id)
            pipe.sadd(f"{self._prefix}tenants", record.tenant_id)
            self._index(pipe, record)
            await pipe.execute()

    def _index(self, pipe: Any, record: FaceRecord) -> None:
        pipe.zadd(self._by_id_key(record.tenant_id), {record.face_id: 0})
        pipe.zadd(self._by_time_key(record.tenant_id), {record.face_id: record.created_at})
        if record.client_reference is not None:
            pipe.zadd(
                self._ref_key(record.tenant_id, record.client_reference), {record.face_id: record.created_at}
            )
            pipe.sadd(self._refs_key(record.tenant_id), _reference_hash(record.client_reference))

    async def get(self, tenant_id: str, face_id: str) -> FaceRecord | None:
        async with redis_errors():
            raw = await self._redis.get(self._face_key(tenant_id, face_id))
        return FaceRecord(**json.loads(raw)) if raw is not None else None

    async def get_many(self, tenant_id: str, face_ids: Sequence[str]) -> dict[str, FaceRecord]:
        if not face_ids:
            return {}
        async with redis_errors():
            raws = await self._redis.mget([self._face_key(tenant_id, face_id) for face_id in face_ids])
        return {
            face_id: FaceRecord(**json.loads(raw))
            for face_id, raw in zip(face_ids, raws, strict=True)
            if raw is not None
        }

    async def count(self, tenant_id: str) -> int:
        async with redis_errors():
            return int(await self._redis.scard(self._faces_key(tenant_id)))

    async def latest_for_reference(self, tenant_id: str, client_reference: str) -> FaceRecord | None:
        key = self._ref_key(tenant_id, client_reference)
        async with redis_errors():
            # A few candidates, newest first, in case the newest index entry outlived its record.
            face_ids = [text(face_id) for face_id in await self._redis.zrevrange(key, 0, 4)]
        records = await self.get_many(tenant_id, face_ids)
        for face_id in face_ids:
            record = records.get(face_id)
            # A face re-put under another reference leaves a stale index entry; skip it.
            if record is not None and record.client_reference == client_reference:
                return record
        return None

    async def delete(self, tenant_id: str, face_id: str) -> None:
        record = await self.get(tenant_id, face_id)
        reference = record.client_reference if record is not None else None
        face_key = self._face_key(tenant_id, face_id)
        keys = [
            face_key,
            self._faces_key(tenant_id),
            self._by_id_key(tenant_id),
            self._by_time_key(tenant_id),
            self._refs_key(tenant_id),
            self._ref_key(tenant_id, reference) if reference is not None else face_key,
        ]
        args = [face_id, _reference_hash(reference) if reference is not None else ""]
        async with redis_errors():
            await self._redis.eval(_DELETE_SCRIPT, len(keys), *keys, *args)

    async def _ensure_indexed(self, tenant_id: str) -> None:
        """Index faces enrolled before the gallery indexes existed (once per tenant). Adding is
        idempotent, so faces enrolled or deleted meanwhile are at worst indexed twice or left as a stale
        entry that the listing skips (it reads the records)."""
        marker = f"{self._prefix}gallery-indexed:{tenant_id}"
        async with redis_errors():
            if await self._redis.exists(marker):
                return
        face_ids = sorted(face_id for _, face_id in await self.all_face_ids(tenant_id))
        for start in range(0, len(face_ids), 1000):
            records = await self.get_many(tenant_id, face_ids[start : start + 1000])
            async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
                for record in records.values():
                    self._index(pipe, record)
                await pipe.execute()
        async with redis_errors():
            await self._redis.set(marker, "1")

    async def page(
        self, tenant_id: str, after: str | None, limit: int
    ) -> tuple[list[FaceRecord], str | None]:
        await self._ensure_indexed(tenant_id)
        start = f"({after}" if after is not None else "-"
        async with redis_errors():
            raw = await self._redis.zrangebylex(self._by_id_key(tenant_id), start, "+", start=0, num=limit)
        face_ids = [text(face_id) for face_id in raw]
        records = await self.get_many(tenant_id, face_ids)
        # An index entry whose record is gone (a delete racing the one-time indexing) is skipped.
        page = [records[face_id] for face_id in face_ids if face_id in records]
        return page, (face_ids[-1] if len(face_ids) == limit else None)

    async def records_for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        async with redis_errors():
            face_ids = sorted(
                text(face_id)
                for face_id in await self._redis.zrange(self._ref_key(tenant_id, client_reference), 0, -1)
            )
        records = await self.get_many(tenant_id, face_ids)
        return [
            records[face_id]
            for face_id in face_ids
            if face_id in records and records[face_id].client_reference == client_reference
        ]

    async def counts(self, tenant_id: str) -> GalleryCounts:
        await self._ensure_indexed(tenant_id)
        by_time = self._by_time_key(tenant_id)
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.scard(self._faces_key(tenant_id))
            pipe.scard(self._refs_key(tenant_id))
            pipe.zrange(by_time, 0, 0, withscores=True)
            pipe.zrange(by_time, -1, -1, withscores=True)
            faces, references, oldest, newest = await pipe.execute()
        return GalleryCounts(
            faces=int(faces),
            client_references=int(references),
            oldest_enrolment=float(oldest[0][1]) if oldest else None,
            newest_enrolment=float(newest[0][1]) if newest else None,
        )

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        async with redis_errors():
            if tenant_id is not None:
                tenants = [tenant_id]
            else:
                tenants = sorted(text(t) for t in await self._redis.smembers(f"{self._prefix}tenants"))
            result: set[tuple[str, str]] = set()
            for tenant in tenants:
                # SSCAN, not SMEMBERS: a large tenant does not block Redis with one huge reply.
                async for face_id in self._redis.sscan_iter(self._faces_key(tenant), count=1000):
                    result.add((tenant, text(face_id)))
        return result

    def _erased_key(self, tenant_id: str, client_reference: str) -> str:
        return f"{self._prefix}erased:{tenant_id}:{_reference_hash(client_reference)}"

    async def mark_erased(self, tenant_id: str, client_reference: str, erased_at: float) -> None:
        async with redis_errors():
            await self._redis.set(
                self._erased_key(tenant_id, client_reference), repr(float(erased_at)), ex=self._erasure_ttl_s
            )

    async def erased_at(self, tenant_id: str, client_reference: str) -> float | None:
        async with redis_errors():
            raw = await self._redis.get(self._erased_key(tenant_id, client_reference))
        return float(raw) if raw is not None else None

    async def tenant_ids(self) -> list[str]:
        async with redis_errors():
            return sorted(text(t) for t in await self._redis.smembers(f"{self._prefix}tenants"))

    def reference_lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> Any:
        """Async context manager holding a Redis lock for (tenant, client_reference).

        The lock expires after timeout_s (so a dead holder cannot block the reference forever) and waiting
        for it gives up after timeout_s with BackendUnavailable (503: the caller may retry).
        """
        return self._reference_lock(tenant_id, client_reference, timeout_s)

    @contextlib.asynccontextmanager
    async def _reference_lock(
        self, tenant_id: str, client_reference: str, timeout_s: float
    ) -> AsyncIterator[None]:
        name = f"{self._prefix}lock:ref:{tenant_id}:{_reference_hash(client_reference)}"
        # thread_local=False: the token lives on the Lock object, which stays within this coroutine.
        lock = self._redis.lock(name, timeout=timeout_s, blocking_timeout=timeout_s, thread_local=False)
        async with redis_errors():
            acquired = await lock.acquire()
        if not acquired:
            raise BackendUnavailable(
                f"Timed out after {timeout_s:g} s waiting for the lock on a client_reference"
            )
        try:
            yield
        finally:
            try:
                await lock.release()
            except redis_exceptions.LockError:
                # It expired while held: another holder may have run meanwhile. The work is done, so
                # report it rather than fail a completed operation.
                logger.warning("reference lock %s expired before release (held > %g s)", name, timeout_s)
            except (redis_exceptions.RedisError, OSError) as error:
                # Release is best effort; the lock expires on its own after timeout_s.
                logger.warning("could not release reference lock %s: %s", name, error)

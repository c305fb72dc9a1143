"""Metadata of enrolled faces in Redis.

Keys (prefix default "fs:"):
  {p}face:{tenant}:{face_id}   JSON of the FaceRecord
  {p}faces:{tenant}            set of the tenant's face ids (all_face_ids, reconciliation)
  {p}tenants                   set of tenants that have had faces
  {p}ref:{tenant}:{sha256(client_reference)}   sorted set face_id -> created_at (latest_for_reference)
  {p}lock:ref:{tenant}:{sha256(client_reference)}   the lock of enrolments, overrides and erasures: its
                               holder's random token, expiring unless renewed (see reference_lock)
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

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import Any

from redis.asyncio import Redis

from serve_app.domain.errors import BackendUnavailable, LockUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import GalleryCounts
from serve_app.stores.interfaces import HeldLock, LockPolicy
from serve_app.stores.redis_support import redis_errors, text

logger = logging.getLogger(__name__)


def _reference_hash(client_reference: str) -> str:
    return hashlib.sha256(client_reference.encode()).hexdigest()


# The fence every write under a face's lock passes first: the lock key (KEYS[1]) must still hold this
# holder's token (ARGV[1]; "" for a write that takes no lock). A holder paused past its lock's expiry finds
# another token there, or none, and writes nothing: -1.
_FENCE = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
"""

# Writes a record and its index entries. KEYS: lock (or the face key), face, faces, tenants, by-id, by-time,
# ref, refs (the last two: the face key again for a record without a reference). ARGV: token, record JSON,
# face_id, tenant, created_at, reference hash ("" for none).
_PUT_SCRIPT = (
    _FENCE
    + """
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('ZADD', KEYS[5], 0, ARGV[3])
redis.call('ZADD', KEYS[6], ARGV[5], ARGV[3])
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[7], ARGV[5], ARGV[3])
  redis.call('SADD', KEYS[8], ARGV[6])
end
return 1
"""
)

# Removes a record and its index entries atomically; the reference leaves the distinct-reference set only
# when its last face goes, which a MULTI cannot decide. KEYS: lock (or the face key), face, faces, by-id,
# by-time, refs, ref (or the face key again when the record had no reference). ARGV: token, face_id,
# reference hash ("" for none).
_DELETE_SCRIPT = (
    _FENCE
    + """
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
if ARGV[3] ~= '' then
  redis.call('ZREM', KEYS[7], ARGV[2])
  if redis.call('ZCARD', KEYS[7]) == 0 then
    redis.call('SREM', KEYS[6], ARGV[3])
  end
end
return 1
"""
)

# KEYS: lock (or the tombstone), tombstone. ARGV: token, erased_at, ttl in s ("" for none).
_ERASED_SCRIPT = (
    _FENCE
    + """
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
else
  redis.call('SET', KEYS[2], ARGV[2])
end
return 1
"""
)

_RENEW_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_LOCK_POLL_S = 0.05


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class _RedisHeldLock:
    """HeldLock of the Redis store: the lock key, this holder's token, and until when (event loop time) the
    lock is known to be this holder's: set from the moment before the command that took or renewed it."""

    def __init__(self, key: str, token: str, valid_until: float) -> None:
        self.key = key
        self.token = token
        self.valid_until = valid_until
        self.lost_reason: str | None = None

    def check(self) -> None:
        if self.lost_reason is None and asyncio.get_running_loop().time() >= self.valid_until:
            self.lost_reason = "its holder was paused past its expiry"
        if self.lost_reason is not None:
            raise LockUnavailable(f"The lock of a client_reference was lost: {self.lost_reason}")


def _fence(lock: HeldLock | None) -> tuple[str, str]:
    """(lock key, token) for the scripts; ("", "") for a write without a lock."""
    if lock is None:
        return "", ""
    if not isinstance(lock, _RedisHeldLock):
        raise TypeError("a HeldLock of another store")  # a programming error, never a client's
    return lock.key, lock.token


def _fenced(result: Any) -> None:
    if int(result) == -1:
        raise LockUnavailable("The lock of a client_reference was lost before a write: another holder has it")


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

    async def put(self, record: FaceRecord, lock: HeldLock | None = None) -> None:
        lock_key, token = _fence(lock)
        face_key = self._face_key(record.tenant_id, record.face_id)
        reference = record.client_reference
        keys = [
            lock_key or face_key,
            face_key,
            self._faces_key(record.tenant_id),
            f"{self._prefix}tenants",
            self._by_id_key(record.tenant_id),
            self._by_time_key(record.tenant_id),
            self._ref_key(record.tenant_id, reference) if reference is not None else face_key,
            self._refs_key(record.tenant_id) if reference is not None else face_key,
        ]
        args = [
            token,
            json.dumps(asdict(record)),
            record.face_id,
            record.tenant_id,
            repr(float(record.created_at)),
            _reference_hash(reference) if reference is not None else "",
        ]
        async with redis_errors():
            _fenced(await self._redis.eval(_PUT_SCRIPT, len(keys), *keys, *args))

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

    async def delete(self, tenant_id: str, face_id: str, lock: HeldLock | None = None) -> None:
        record = await self.get(tenant_id, face_id)
        reference = record.client_reference if record is not None else None
        lock_key, token = _fence(lock)
        face_key = self._face_key(tenant_id, face_id)
        keys = [
            lock_key or face_key,
            face_key,
            self._faces_key(tenant_id),
            self._by_id_key(tenant_id),
            self._by_time_key(tenant_id),
            self._refs_key(tenant_id),
            self._ref_key(tenant_id, reference) if reference is not None else face_key,
        ]
        args = [token, face_id, _reference_hash(reference) if reference is not None else ""]
        async with redis_errors():
            _fenced(await self._redis.eval(_DELETE_SCRIPT, len(keys), *keys, *args))

    async def existing(self, faces: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        if not faces:
            return set()
        async with redis_errors(), self._redis.pipeline(transaction=False) as pipe:
            for tenant_id, face_id in faces:
                pipe.exists(self._face_key(tenant_id, face_id))
            found = await pipe.execute()
        return {face for face, exists in zip(faces, found, strict=True) if exists}

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

    async def mark_erased(
        self, tenant_id: str, client_reference: str, erased_at: float, lock: HeldLock | None = None
    ) -> None:
        lock_key, token = _fence(lock)
        tombstone = self._erased_key(tenant_id, client_reference)
        ttl = str(self._erasure_ttl_s) if self._erasure_ttl_s else ""
        async with redis_errors():
            _fenced(
                await self._redis.eval(
                    _ERASED_SCRIPT, 2, lock_key or tombstone, tombstone, token, repr(float(erased_at)), ttl
                )
            )

    async def erased_at(self, tenant_id: str, client_reference: str) -> float | None:
        async with redis_errors():
            raw = await self._redis.get(self._erased_key(tenant_id, client_reference))
        return float(raw) if raw is not None else None

    async def tenant_ids(self) -> list[str]:
        async with redis_errors():
            return sorted(text(t) for t in await self._redis.smembers(f"{self._prefix}tenants"))

    def reference_lock(
        self, tenant_id: str, client_reference: str, policy: LockPolicy
    ) -> contextlib.AbstractAsyncContextManager[HeldLock]:
        return self._reference_lock(tenant_id, client_reference, policy)

    @contextlib.asynccontextmanager
    async def _reference_lock(
        self, tenant_id: str, client_reference: str, policy: LockPolicy
    ) -> AsyncIterator[HeldLock]:
        key = f"{self._prefix}lock:ref:{tenant_id}:{_reference_hash(client_reference)}"
        token = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.wait_s
        while True:
            asked_at = loop.time()
            async with redis_errors():
                if await self._redis.set(key, token, nx=True, px=_ms(policy.ttl_s)):
                    break
            if loop.time() >= deadline:
                raise LockUnavailable(
                    f"Timed out after {policy.wait_s:g} s waiting for the lock on a client_reference"
                )
            await asyncio.sleep(min(_LOCK_POLL_S, max(0.0, deadline - loop.time())))
        held = _RedisHeldLock(key, token, asked_at + policy.ttl_s)
        renewal = asyncio.create_task(self._renew(held, policy, asked_at + policy.max_hold_s))
        try:
            yield held
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
            try:
                async with redis_errors():
                    await self._redis.eval(_RELEASE_LOCK, 1, key, token)
            except BackendUnavailable as error:
                # Release is best effort; the lock expires on its own ttl_s after its last renewal.
                logger.warning("could not release reference lock %s: %s", key, error.message)

    async def _renew(self, held: _RedisHeldLock, policy: LockPolicy, renew_until: float) -> None:
        """Keep the lock while its holder works: renewed every ttl_s / 3 until renew_until. A renewal that
        finds the lock gone marks it lost (HeldLock.check raises from then on, and the fence refuses the
        record writes anyway); one that cannot reach Redis is retried, and the lock counts as lost once
        its ttl has passed since the last renewal that succeeded."""
        loop = asyncio.get_running_loop()
        while held.lost_reason is None:
            await asyncio.sleep(policy.ttl_s / 3)
            if loop.time() >= renew_until:
                # Left to expire: a holder stuck this long must not block the reference for ever.
                logger.warning(
                    "reference lock %s held past %g s: no longer renewed", held.key, policy.max_hold_s
                )
                return
            asked_at = loop.time()
            try:
                async with redis_errors():
                    renewed = await self._redis.eval(_RENEW_LOCK, 1, held.key, held.token, _ms(policy.ttl_s))
            except BackendUnavailable as error:
                logger.warning("could not renew reference lock %s: %s", held.key, error.message)
                continue
            if not renewed:
                held.lost_reason = "another holder took it after it expired"
                logger.warning("reference lock %s was lost while held", held.key)
                return
            held.valid_until = asked_at + policy.ttl_s

"""Reconciliation's shared state in Redis (the ReconcileState of pipelines/reconcile.py).

Keys (prefix default "fs:"):
  {p}sys:lease:reconcile                  the holder's id, expiring: one pass at a time (redis_lease.py)
  {p}reconcile:cursor                     where the pass under way stopped (resumed by the next holder)
  {p}reconcile:last-pass                  when the last pass completed (seconds since the epoch)
  {p}reconcile:suspects:{kind}:{tenant}   sorted set face_id -> when it was first seen inconsistent
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_support import redis_errors, text


class RedisReconcileState:
    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._redis = redis
        self._lease = RedisLease(redis, "reconcile", prefix)
        self._cursor = f"{prefix}reconcile:cursor"
        self._last = f"{prefix}reconcile:last-pass"
        self._suspects = f"{prefix}reconcile:suspects"

    def _suspect_key(self, kind: str, tenant_id: str) -> str:
        return f"{self._suspects}:{kind}:{tenant_id}"

    async def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        return await self._lease.acquire(holder, ttl_s)

    async def renew_lease(self, holder: str, ttl_s: float) -> bool:
        return await self._lease.renew(holder, ttl_s)

    async def release_lease(self, holder: str) -> None:
        await self._lease.release(holder)

    async def load_cursor(self) -> str | None:
        async with redis_errors():
            raw = await self._redis.get(self._cursor)
        return text(raw) if raw is not None else None

    async def save_cursor(self, cursor: str | None) -> None:
        async with redis_errors():
            if cursor is None:
                await self._redis.delete(self._cursor)
            else:
                await self._redis.set(self._cursor, cursor)

    async def add_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str], seen_at: float) -> None:
        if face_ids:
            async with redis_errors():
                await self._redis.zadd(
                    self._suspect_key(kind, tenant_id), dict.fromkeys(face_ids, seen_at), nx=True
                )

    async def due_suspects(
        self, kind: str, tenant_id: str, seen_before: float, offset: int, limit: int
    ) -> list[str]:
        async with redis_errors():
            raw = await self._redis.zrangebyscore(
                self._suspect_key(kind, tenant_id), "-inf", seen_before, start=offset, num=limit
            )
        return [text(face_id) for face_id in raw]

    async def drop_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str]) -> None:
        if face_ids:
            async with redis_errors():
                await self._redis.zrem(self._suspect_key(kind, tenant_id), *face_ids)

    async def count_suspects(self, kind: str, tenant_id: str) -> int:
        async with redis_errors():
            return int(await self._redis.zcard(self._suspect_key(kind, tenant_id)))

    async def complete_pass(self, at: float) -> None:
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._last, repr(at))
            pipe.delete(self._cursor)
            await pipe.execute()

    async def last_completed(self) -> float | None:
        async with redis_errors():
            raw = await self._redis.get(self._last)
        return float(text(raw)) if raw is not None else None

"""Reconciliation's shared state in Redis (the ReconcileState of pipelines/reconcile.py).

Keys (prefix default "fs:"):
  {p}sys:lease:reconcile                  the holder's id, expiring: one pass at a time (redis_lease.py)
  {p}sys:job:reconcile:cursor             where the pass under way stopped (resumed by the next holder)
  {p}sys:job:reconcile:last-pass          when the last pass completed (seconds since the epoch)
  {p}reconcile:suspects:{kind}:{tenant}   sorted set face_id -> when it was first seen inconsistent
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_support import redis_errors, text


class RedisReconcileState(RedisLease):
    """interfaces.ReconcileState: the reconcile job's lease and fields, and the suspects."""

    LEASE = "reconcile"  # the job's lease name

    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        super().__init__(redis, self.LEASE, prefix)
        self._suspects = f"{prefix}reconcile:suspects"

    def _suspect_key(self, kind: str, tenant_id: str) -> str:
        return f"{self._suspects}:{kind}:{tenant_id}"

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

    async def last_completed(self) -> float | None:
        raw = await self.read("last-pass")
        return float(raw) if raw is not None else None

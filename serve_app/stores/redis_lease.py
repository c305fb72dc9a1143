"""A lease in Redis: one holder at a time for a cluster-wide periodic job, lost when the holder stops
renewing it (a crashed holder's lease lapses after its time to live).

Key: {p}sys:lease:{name}, holding the holder's name, with a millisecond expiry.
"""

from __future__ import annotations

from redis.asyncio import Redis

from serve_app.stores.redis_support import redis_errors

# Renew when ours, else take when free. KEYS: the lease. ARGV: holder, ttl in ms.
_ACQUIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""


class RedisLease:
    def __init__(self, redis: Redis, name: str, prefix: str = "fs:") -> None:
        self._key = f"{prefix}sys:lease:{name}"
        self._acquire = redis.register_script(_ACQUIRE)

    async def acquire(self, holder: str, ttl_s: float) -> bool:
        async with redis_errors():
            return bool(await self._acquire(keys=[self._key], args=[holder, max(1, int(ttl_s * 1000))]))

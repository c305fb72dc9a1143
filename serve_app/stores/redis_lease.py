"""Cluster-wide leases in Redis: one holder at a time for a job (reconciliation, the result archive and its
retention sweep, a gallery's index switch), lost when the holder stops renewing it (a crashed holder's lease
lapses after its time to live). Every lease of the service is this one mechanism.

Keys: {p}sys:lease:{name}, holding the holder's name, with a millisecond expiry; {p}sys:job:{name}:{field},
the job's state fields (a cursor, when a pass last completed), written only by the lease's holder, checked
atomically with each write (the fence of a holder that lost its lease while paused).
"""

from __future__ import annotations

from redis.asyncio import Redis

from serve_app.stores.redis_support import redis_errors, text

# Renew when ours, else take when free. KEYS: the lease. ARGV: holder, ttl in ms.
_ACQUIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
# Extend or give back only while this holder has it: a holder whose lease expired and was taken over must
# never cut the new holder's lease short.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# Set or delete state fields only while the holder has the lease. KEYS: the lease, then the fields. ARGV:
# holder, then per field "s" + value to set, or "d" to delete.
_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
for i = 2, #KEYS do
  if string.sub(ARGV[i], 1, 1) == 's' then
    redis.call('SET', KEYS[i], string.sub(ARGV[i], 2))
  else
    redis.call('DEL', KEYS[i])
  end
end
return 1
"""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisLease:
    """interfaces.JobLease."""

    def __init__(self, redis: Redis, name: str, prefix: str = "fs:") -> None:
        self._redis = redis
        self._key = f"{prefix}sys:lease:{name}"
        self._fields = f"{prefix}sys:job:{name}:"
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._write = redis.register_script(_WRITE)

    async def acquire(self, holder: str, ttl_s: float) -> bool:
        """Take the lease if free, or renew it if `holder` has it; True when `holder` holds it now."""
        async with redis_errors():
            return bool(await self._acquire(keys=[self._key], args=[holder, _ms(ttl_s)]))

    async def renew(self, holder: str, ttl_s: float) -> bool:
        """Extend the lease by ttl_s from now; False when `holder` no longer has it."""
        async with redis_errors():
            return bool(await self._renew(keys=[self._key], args=[holder, _ms(ttl_s)]))

    async def release(self, holder: str) -> None:
        async with redis_errors():
            await self._release(keys=[self._key], args=[holder])

    async def read(self, field: str) -> str | None:
        async with redis_errors():
            raw = await self._redis.get(self._fields + field)
        return text(raw) if raw is not None else None

    async def write(self, holder: str, values: dict[str, str | None]) -> bool:
        keys = [self._key, *(self._fields + field for field in values)]
        args = [holder, *("d" if value is None else "s" + value for value in values.values())]
        async with redis_errors():
            return bool(await self._write(keys=keys, args=args))

"""Cluster-wide leases in Redis: one holder at a time for a job (the result archive, reconciliation, a
gallery's index switch), lost when the holder stops renewing it (a crashed holder's lease lapses after its
time to live). Every lease of the service is this one mechanism.

Key: {p}sys:lease:{name}, holding the holder's name, with a millisecond expiry.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from serve_app.domain.errors import BackendUnavailable
from serve_app.stores.redis_support import redis_errors

logger = logging.getLogger(__name__)

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


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisLease:
    def __init__(self, redis: Redis, name: str, prefix: str = "fs:") -> None:
        self._key = f"{prefix}sys:lease:{name}"
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

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


class RedisLeases:
    """interfaces.Leases: leases named per call, each taken once without waiting and given back on exit."""

    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._redis = redis
        self._prefix = prefix

    @contextlib.asynccontextmanager
    async def try_hold(self, name: str, ttl_s: float) -> AsyncIterator[bool]:
        lease = RedisLease(self._redis, name, self._prefix)
        holder = secrets.token_hex(16)
        held = await lease.acquire(holder, ttl_s)
        try:
            yield held
        finally:
            if held:
                try:
                    await lease.release(holder)
                except BackendUnavailable as error:
                    logger.warning("could not give back lease %s (it expires on its own): %s", name, error)

"""Fixed-window rate limiting in Redis: one counter per key that expires when its window ends.

Keys (prefix default "fs:"):
  {p}rl:{sha256(key)}   the counter of one limiter key

Limiter keys carry caller-supplied parts (client ids, addresses), so they only appear in key names hashed.

INCR and the expiry run in one Lua script, so a client dying between the two can never leave a counter
without expiry (which would lock the key out for good); the script also returns the time left, so one round
trip answers both "allowed?" and "retry after how long?".
"""

from __future__ import annotations

import hashlib
import math

from redis.asyncio import Redis

from serve_app.stores.redis_support import redis_errors

# Returns {count after increment, milliseconds until the window ends}.
_HIT = """
local count = redis.call('INCR', KEYS[1])
local ttl = redis.call('PTTL', KEYS[1])
if count == 1 or ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {count, ttl}
"""


class RedisRateLimiter:
    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._redis = redis
        self._prefix = prefix
        self._hit = redis.register_script(_HIT)

    def _key(self, key: str) -> str:
        return f"{self._prefix}rl:{hashlib.sha256(key.encode()).hexdigest()}"

    async def hit(self, key: str, limit: int, window_s: int) -> int:
        """Count one event; 0 when it is within `limit` for the current window, else whole seconds (>= 1)
        until the window ends."""
        async with redis_errors():
            count, ttl_ms = await self._hit(keys=[self._key(key)], args=[max(1, int(window_s * 1000))])
        if int(count) <= limit:
            return 0
        return max(1, math.ceil(int(ttl_ms) / 1000))

    async def peek(self, key: str, limit: int, window_s: int) -> int:
        """Like hit() without counting: seconds until the window ends when `limit` events were already
        counted in it (the next hit would be refused), else 0."""
        async with redis_errors(), self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self._key(key))
            pipe.pttl(self._key(key))
            raw_count, ttl_ms = await pipe.execute()
        if raw_count is None or int(raw_count) < limit:
            return 0
        if int(ttl_ms) < 0:
            return max(1, int(window_s))
        return max(1, math.ceil(int(ttl_ms) / 1000))

    async def reset(self, key: str) -> None:
        async with redis_errors():
            await self._redis.delete(self._key(key))

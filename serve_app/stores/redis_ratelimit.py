"""Rate limiting in Redis: fixed windows (hit) and attempts with a growing back-off (attempt).

Keys (prefix default "fs:"):
  {p}rl:{sha256(key)}   a fixed window's counter, or an attempt key's hash {n: attempts, until: ms}

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


def fixed_window_count_lua(counter: str) -> str:
    """The Lua that counts one event in a fixed window: `counter` names the key (e.g. "KEYS[1]"), ARGV[1] is
    the window in ms. It returns {count after increment, ms until the window ends}; window_verdict reads it.
    Also the tail of the admission script (redis_admission), so both count the same way."""
    return f"""
local count = redis.call('INCR', {counter})
local ttl = redis.call('PTTL', {counter})
if count == 1 or ttl < 0 then
  redis.call('PEXPIRE', {counter}, ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {{count, ttl}}
"""


def window_ms(window_s: float) -> int:
    return max(1, int(window_s * 1000))


def window_verdict(count: int, ttl_ms: int, limit: int) -> int:
    """0 when the count is within `limit`, else whole seconds (>= 1) until the window ends."""
    if int(count) <= limit:
        return 0
    return max(1, math.ceil(int(ttl_ms) / 1000))


_HIT = fixed_window_count_lua("KEYS[1]")


# Check and count in one step, so parallel attempts cannot all pass a check made before any of them was
# counted. KEYS[1]: hash {n, until}; ARGV: free attempts, base back-off ms, max back-off ms, memory ms.
# Returns the milliseconds to wait (0: go ahead, counted). The server's clock, so ingress replicas agree.
_ATTEMPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local blocked = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if blocked > now then return blocked - now end
local n = redis.call('HINCRBY', KEYS[1], 'n', 1)
local wait = 0
if n >= tonumber(ARGV[1]) then
  wait = math.min(tonumber(ARGV[2]) * 2 ^ (n - tonumber(ARGV[1])), tonumber(ARGV[3]))
  wait = math.floor(wait)
  redis.call('HSET', KEYS[1], 'until', now + wait)
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]) + wait)
return 0
"""


def limiter_key(prefix: str, key: str) -> str:
    return f"{prefix}rl:{hashlib.sha256(key.encode()).hexdigest()}"


class RedisRateLimiter:
    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._redis = redis
        self._prefix = prefix
        self._hit = redis.register_script(_HIT)
        self._attempt = redis.register_script(_ATTEMPT)

    def _key(self, key: str) -> str:
        return limiter_key(self._prefix, key)

    async def hit(self, key: str, limit: int, window_s: int) -> int:
        """Count one event; 0 when it is within `limit` for the current window, else whole seconds (>= 1)
        until the window ends."""
        async with redis_errors():
            count, ttl_ms = await self._hit(keys=[self._key(key)], args=[window_ms(window_s)])
        return window_verdict(count, ttl_ms, limit)

    async def attempt(
        self, key: str, free_attempts: int, base_s: float, max_s: float, memory_s: float
    ) -> int:
        """Count one attempt unless the key is backing off; 0 when counted (go ahead), else whole seconds
        (>= 1) until the next attempt may be made.

        free_attempts attempts go ahead back to back; after them each attempt has to wait, base_s at first,
        doubling per attempt up to max_s. reset() (a success) forgets them; so does memory_s without an
        attempt."""
        async with redis_errors():
            wait_ms = await self._attempt(
                keys=[self._key(key)],
                args=[max(1, free_attempts), int(base_s * 1000), int(max_s * 1000), int(memory_s * 1000)],
            )
        return 0 if int(wait_ms) <= 0 else max(1, math.ceil(int(wait_ms) / 1000))

    async def reset(self, key: str) -> None:
        async with redis_errors():
            await self._redis.delete(self._key(key))

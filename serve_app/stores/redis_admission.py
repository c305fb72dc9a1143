"""Admitting an authenticated request in one Redis round trip: is the client still active, and is it within
its request allowance? Both used to be a round trip of their own on every request (the client's hash, then
the rate-limit script); one script reads the revoked flag and, only for an active client, counts the request
in the same fixed window RedisRateLimiter.hit uses for `requests:<client_id>`.

Keys: the client hash of redis_clients ({p}client:{id}, field revoked "0"/"1") and the counter of
redis_ratelimit ({p}rl:{sha256(requests:<id>)}).
"""

from __future__ import annotations

import math

from redis.asyncio import Redis

from serve_app.domain.identifiers import is_client_id
from serve_app.stores.interfaces import Admission, request_counter_key
from serve_app.stores.redis_clients import client_key
from serve_app.stores.redis_ratelimit import limiter_key
from serve_app.stores.redis_support import redis_errors

# KEYS[1]: client hash, KEYS[2]: request counter; ARGV[1]: window ms.
# Returns {-1, 0} for an unknown or revoked client (nothing counted), else {count, ms until the window ends}.
_ADMIT = """
local revoked = redis.call('HGET', KEYS[1], 'revoked')
if not revoked or revoked == '1' then return {-1, 0} end
local count = redis.call('INCR', KEYS[2])
local ttl = redis.call('PTTL', KEYS[2])
if count == 1 or ttl < 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {count, ttl}
"""


class RedisRequestAdmission:
    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._prefix = prefix
        self._admit = redis.register_script(_ADMIT)

    async def admit(self, client_id: str, limit: int, window_s: int) -> Admission:
        if not is_client_id(client_id):
            return Admission(active=False)
        keys = [
            client_key(self._prefix, client_id),
            limiter_key(self._prefix, request_counter_key(client_id)),
        ]
        async with redis_errors():
            count, ttl_ms = await self._admit(keys=keys, args=[max(1, int(window_s * 1000))])
        if int(count) < 0:
            return Admission(active=False)
        if int(count) <= limit:
            return Admission(active=True)
        return Admission(active=True, retry_after_s=max(1, math.ceil(int(ttl_ms) / 1000)))

"""Admitting an authenticated request in one Redis round trip: is the client still active, and is it within
its request allowance? Both used to be a round trip of their own on every request (the client's hash, then
the rate-limit script); one script reads the revoked flag and, only for an active client, counts the request
in the same fixed window RedisRateLimiter.hit uses for `requests:<client_id>`.

Keys: the client hash of redis_clients ({p}client:{id}, field revoked "0"/"1") and the counter of
redis_ratelimit ({p}rl:{sha256(requests:<id>)}).
"""

from __future__ import annotations

from redis.asyncio import Redis

from serve_app.domain.identifiers import is_client_id
from serve_app.stores.interfaces import Admission, request_counter_key
from serve_app.stores.redis_clients import client_key
from serve_app.stores.redis_ratelimit import fixed_window_count_lua, limiter_key, window_ms, window_verdict
from serve_app.stores.redis_support import redis_errors

# KEYS[1]: client hash, KEYS[2]: request counter; ARGV[1]: window ms.
# Returns {-1, 0} for an unknown or revoked client (nothing counted), else {count, ms until the window ends}.
_ADMIT = """
local revoked = redis.call('HGET', KEYS[1], 'revoked')
if not revoked or revoked == '1' then return {-1, 0} end
""" + fixed_window_count_lua("KEYS[2]")


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
            count, ttl_ms = await self._admit(keys=keys, args=[window_ms(window_s)])
        if int(count) < 0:
            return Admission(active=False)
        return Admission(active=True, retry_after_s=window_verdict(count, ttl_ms, limit))

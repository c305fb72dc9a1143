"""interfaces.TenantWriteClock in Redis: per tenant, the Milvus timestamp of its newest acknowledged gallery
write, which a search passes to Milvus as its guarantee (milvus_gallery, "Consistency").

Key: {p}gallery-clock:{tenant}, the timestamp in decimal, without expiry (one small key per tenant).
Raised by a script, never lowered: two replicas writing for one tenant at once leave the greater one.
Milvus timestamps are 64-bit hybrid clocks (~4.7e17 today), past the 2^53 that Lua numbers hold exactly,
so the script compares them as decimal strings (longer is greater, then lexically).
"""

from __future__ import annotations

from redis.asyncio import Redis

from serve_app.stores.redis_support import redis_errors

_ADVANCE = """
local current = redis.call('GET', KEYS[1])
local new = ARGV[1]
if not current or #new > #current or (#new == #current and new > current) then
  redis.call('SET', KEYS[1], new)
end
return 1
"""


class RedisTenantClock:
    def __init__(self, redis: Redis, prefix: str = "fs:") -> None:
        self._redis = redis
        self._prefix = f"{prefix}gallery-clock:"
        self._advance = redis.register_script(_ADVANCE)

    async def advance(self, tenant_id: str, timestamp: int) -> None:
        if timestamp <= 0:
            return  # no timestamp to wait for (a server that gave none)
        async with redis_errors():
            await self._advance(keys=[self._prefix + tenant_id], args=[str(int(timestamp))])

    async def read(self, tenant_id: str) -> int:
        async with redis_errors():
            value = await self._redis.get(self._prefix + tenant_id)
        return int(value) if value else 0

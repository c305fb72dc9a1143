"""Cluster-wide leases in Redis (interfaces.Leases): a key set with NX and an expiry, given back only by its
holder (redis-py's Lock: a random token compared in a Lua script)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from redis import exceptions as redis_exceptions
from redis.asyncio import Redis

from serve_app.stores.redis_support import redis_errors

logger = logging.getLogger(__name__)


class RedisLeases:
    def __init__(self, redis: Redis, prefix: str = "") -> None:
        self._redis = redis
        self._prefix = prefix

    @contextlib.asynccontextmanager
    async def try_hold(self, name: str, ttl_s: float) -> AsyncIterator[bool]:
        key = f"{self._prefix}lease:{name}"
        # thread_local=False: the token lives on the Lock object, which stays within this coroutine.
        lock = self._redis.lock(key, timeout=ttl_s, blocking=False, thread_local=False)
        async with redis_errors():
            held = bool(await lock.acquire())
        try:
            yield held
        finally:
            if held:
                try:
                    await lock.release()
                except redis_exceptions.LockError:
                    logger.warning("lease %s expired before it was given back (held > %g s)", key, ttl_s)
                except (redis_exceptions.RedisError, OSError) as error:
                    logger.warning("could not give back lease %s (it expires on its own): %s", key, error)

"""Redis client construction and error translation shared by the redis_* stores.

Callers above the stores never see redis-py exceptions: every redis call runs inside `redis_errors()` (or
a method decorated with `translate_redis_errors`), which turns them into BackendUnavailable.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar

from redis import exceptions as redis_exceptions
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from serve_app.domain.errors import BackendRejected, BackendUnavailable

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_SOCKET_TIMEOUT_S = 5.0
# Error replies that describe the server's state, not the command: they pass when the server recovers.
# redis-py raises its own classes for some (prefix stripped from the message); others keep their prefix.
_SERVER_STATE_CLASSES = (
    redis_exceptions.OutOfMemoryError,
    redis_exceptions.ReadOnlyError,
    redis_exceptions.NoPermissionError,
    redis_exceptions.TryAgainError,
    redis_exceptions.ClusterDownError,
    redis_exceptions.MasterDownError,
)
_SERVER_STATE_PREFIXES = ("MISCONF", "BUSY", "NOREPLICAS", "UNBLOCKED")


def connect_redis(
    url: str,
    *,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    connect_timeout_s: float = 2.0,
    health_check_interval_s: int = 15,
    retries: int = 2,
    max_connections: int | None = None,
) -> Redis:
    """An asyncio client for `url` (redis://, rediss:// or unix://). No I/O happens until the first call.

    - socket timeouts bound how long a dead or blackholed server can stall a request;
    - health_check_interval pings connections idle longer than that before reuse, so a connection cut by
      a Redis restart is replaced instead of failing the first request after it;
    - connection and timeout errors are retried `retries` times with a short jittered backoff, which
      rides over a restart of the server without masking a real outage for long.
    Stores that block (XREADGROUP BLOCK, BLPOP) keep each wait shorter than socket_timeout_s.
    """
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries)
    return Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_keepalive=True,
        health_check_interval=health_check_interval_s,
        retry=retry,
        retry_on_error=[redis_exceptions.ConnectionError, redis_exceptions.TimeoutError],
        max_connections=max_connections,
    )


def text(value: object) -> str:
    """A reply value as str. Clients from connect_redis decode replies already; this narrows the type
    (redis-py annotates replies loosely) and copes with a client that does not decode."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string reply, got {type(value).__name__}")


def text_map(mapping: Mapping[Any, Any]) -> dict[str, str]:
    """An HGETALL reply as dict[str, str]."""
    return {text(key): text(value) for key, value in mapping.items()}


def socket_timeout_of(client: Redis) -> float | None:
    """The read timeout the client's connections use (None: no timeout)."""
    value = client.connection_pool.connection_kwargs.get("socket_timeout")
    return None if value is None else float(value)


def to_backend_unavailable(error: BaseException) -> BackendUnavailable:
    if isinstance(error, redis_exceptions.ConnectionError | redis_exceptions.TimeoutError | OSError):
        return BackendUnavailable(f"Redis is unavailable: {error}")
    # Anything else (a ResponseError such as MISCONF or OOM, or a bug) is still reported as the backend
    # failing, but logged with its traceback so a bug does not hide behind a 503.
    logger.error("unexpected Redis error", exc_info=error)
    message = f"Redis is unavailable: {type(error).__name__}: {error}"
    server_state = isinstance(error, _SERVER_STATE_CLASSES) or str(error).startswith(_SERVER_STATE_PREFIXES)
    if isinstance(error, redis_exceptions.ResponseError) and not server_state:
        # WRONGTYPE, a script error, a bad argument: this command fails the same way every time.
        return BackendRejected(message)
    return BackendUnavailable(message)


@asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """Run the enclosed redis calls, translating redis/socket errors into BackendUnavailable."""
    try:
        yield
    except (redis_exceptions.RedisError, OSError) as error:
        raise to_backend_unavailable(error) from error


def translate_redis_errors(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Decorator form of redis_errors() for async store methods."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except (redis_exceptions.RedisError, OSError) as error:
            raise to_backend_unavailable(error) from error

    return wrapper

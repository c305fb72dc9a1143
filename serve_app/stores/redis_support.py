"""Redis client construction and error translation shared by the redis_* stores.

Callers above the stores never see redis-py exceptions: every redis call runs inside `redis_errors()`,
which turns them into BackendUnavailable.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from redis import exceptions as redis_exceptions
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection
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


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


class _FailoverAwareConnection(SentinelManagedConnection):
    """After a failover, a script's write to the demoted master fails as a script error that wraps
    READONLY, which redis-py's own check (a plain ReadOnlyError only) misses: the connection would stay on
    the old master for good. Drop it the same way, as a connection error, so the client's retry opens a
    new connection and asks the sentinels for the new master."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis_exceptions.ResponseError as error:
            if "READONLY" not in str(error) or not self.connection_pool.is_master:
                raise
            await self.disconnect()
            raise redis_exceptions.ConnectionError("the previous master is now a replica") from error


class _FailoverAwareSSLConnection(_FailoverAwareConnection, SentinelManagedSSLConnection):
    pass


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed `redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]` URL.
    The credentials are the master's (and replicas'); `?sentinel_password=` authenticates to the
    sentinels when they require it. rediss+sentinel:// uses TLS to the master."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int
    username: str | None
    password: str | None
    sentinel_password: str | None
    tls: bool


def parse_sentinel_url(url: str) -> SentinelTarget:
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a sentinel URL (expected {' or '.join(SENTINEL_SCHEMES)}://)")
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    sentinels = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("a sentinel URL ends with /service_name or /service_name/db")
    query = parse_qs(parts.query)
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service_name=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=query.get("sentinel_password", [None])[0],
        tls=parts.scheme.startswith("rediss"),
    )


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0] in SENTINEL_SCHEMES


async def check_eviction_policy(redis: Redis) -> str | None:
    """The server's `maxmemory-policy` as INFO reports it (None where a managed Redis hides it, or Redis is
    away), logged as an error unless it is noeviction: any other policy lets Redis delete keys at
    maxmemory, queued transactions, locks and leases among them, so accepted work could be lost."""
    try:
        async with redis_errors():
            info: dict[str, Any] = await redis.info("memory")
    except BackendUnavailable as error:
        logger.debug("Redis eviction policy not read: %s", error.message)
        return None
    policy = info.get("maxmemory_policy")
    if policy is not None and policy != "noeviction":
        logger.error(
            "Redis runs with maxmemory-policy %s: at maxmemory it deletes keys, queued transactions and "
            "locks among them, and accepted work can be lost. Set maxmemory-policy noeviction "
            "(docs/scaling.md, 'Redis memory').",
            policy,
        )
    return None if policy is None else str(policy)


def connect_redis(
    url: str,
    *,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    connect_timeout_s: float = 2.0,
    health_check_interval_s: int = 15,
    retries: int = 2,
    max_connections: int | None = None,
) -> Redis:
    """An asyncio client for `url` (redis://, rediss://, unix://, or redis+sentinel:// for the master of a
    Sentinel-monitored group, see SentinelTarget). No I/O happens until the first call.

    - socket timeouts bound how long a dead or blackholed server can stall a request;
    - health_check_interval pings connections idle longer than that before reuse, so a connection cut by
      a Redis restart is replaced instead of failing the first request after it;
    - connection and timeout errors are retried `retries` times with a short jittered backoff, which
      rides over a restart of the server without masking a real outage for long.
    Stores that block (XREADGROUP BLOCK, BLPOP) keep each wait shorter than socket_timeout_s.
    """
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries)
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "socket_keepalive": True,
        "health_check_interval": health_check_interval_s,
        "retry": retry,
        "retry_on_error": [redis_exceptions.ConnectionError, redis_exceptions.TimeoutError],
        "max_connections": max_connections,
    }
    if not is_sentinel_url(url):
        return Redis.from_url(url, **options)
    # Sentinel: every new connection asks the sentinels for the current master, and a connection to a
    # server that is no longer master is dropped (redis-py's SentinelConnectionPool), so after a failover
    # the retry above lands on the new master.
    target = parse_sentinel_url(url)
    sentinel_options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "decode_responses": True,
    }
    if target.sentinel_password:
        sentinel_options["password"] = target.sentinel_password
    # redis-py's Sentinel constructor carries no annotations.
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_options)  # type: ignore[no-untyped-call]
    master: Redis = sentinel.master_for(
        target.service_name,
        redis_class=Redis,
        db=target.db,
        username=target.username,
        password=target.password,
        connection_class=_FailoverAwareSSLConnection if target.tls else _FailoverAwareConnection,
        **options,
    )
    return master


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
    message = f"Redis is unavailable: {type(error).__name__}: {error}"
    server_state = (
        isinstance(error, _SERVER_STATE_CLASSES)
        or str(error).startswith(_SERVER_STATE_PREFIXES)
        # A script's error wraps the server's reply: "Error running script ...: -READONLY ...".
        or any(
            f"-{state}" in str(error) for state in (*_SERVER_STATE_PREFIXES, "READONLY", "OOM", "MASTERDOWN")
        )
    )
    if server_state:
        # The server's state (at maxmemory: OOM; unable to write its files: MISCONF; a replica: READONLY)
        # refuses it for now: an outage that passes, reported by whoever handles the 503 or the requeue,
        # without a traceback per request while it lasts.
        return BackendUnavailable(message)
    # Anything else (a bug, or a reply this command gets every time) is still reported as the backend
    # failing, but logged with its traceback so a bug does not hide behind a 503.
    logger.error("unexpected Redis error", exc_info=error)
    if isinstance(error, redis_exceptions.ResponseError):
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

"""Makes Ray Serve's direct ingress survive its own replica's death and a restart at once.

With direct ingress the ingress replica listens on the public port itself. Ray Serve 2.60 binds that socket
without SO_REUSEADDR, so after the replica is killed (or the whole service is stopped and started again)
the connections it left in TIME_WAIT or FIN_WAIT make the next replica's bind fail with EADDRINUSE for up
to a minute. Serve then marks the port "blocked" in its controller for good, and with a one-port range
no replica can ever start again: a permanent outage after one crash.

Two changes, applied in the ingress replica's process before Serve opens its server (the replica's
constructor runs first):
- every listening socket Serve's HTTP helper opens sets SO_REUSEADDR, the flag uvicorn and every other
  server set for this reason. Linux then lets a new listener bind over sockets in TIME_WAIT whose listener
  also had the flag, and still refuses while another socket is listening on the port;
- a bind that fails because the port is in use is tried again for a while (the old replica of a service
  stopped a moment ago may still be exiting) before Serve is told, so Serve blocks the port only when
  something else keeps it.

Both touch Ray Serve's private modules: ray is pinned exactly (pyproject.toml) and
tests/unit/test_direct_ingress.py fails if the names this relies on move.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

# How long a replica waits for its port to be released before Serve hears of the failure: longer than a
# stopping service's Ray workers take to exit, shorter than Serve's patience with a starting replica.
BIND_WAIT_S = 45.0
BIND_RETRY_INTERVAL_S = 0.25

_ADDRESS_IN_USE = frozenset({errno.EADDRINUSE})


class _AddressReusingSocketModule:
    """Stands in for the `socket` module inside Ray Serve's HTTP helper: the same module, except that the
    sockets it makes set SO_REUSEADDR before anything binds them."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def socket(self, *args: Any, **kwargs: Any) -> socket.socket:
        sock: socket.socket = self._real.socket(*args, **kwargs)
        sock.setsockopt(self._real.SOL_SOCKET, self._real.SO_REUSEADDR, 1)
        return sock


StartServer = Callable[..., Awaitable[Any]]


def _address_in_use(error: BaseException) -> bool:
    # Serve's helper raises RuntimeError with the OSError of bind() as its cause.
    cause = error.__cause__
    return isinstance(cause, OSError) and cause.errno in _ADDRESS_IN_USE


def waiting_for_the_port(
    start_server: StartServer, wait_s: float = BIND_WAIT_S, interval_s: float = BIND_RETRY_INTERVAL_S
) -> StartServer:
    """start_server (Serve's start_asgi_http_server), tried again while its bind finds the port in use,
    for up to wait_s; any other error, or the last one, is raised as it came."""

    async def start(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + wait_s
        waited = False
        while True:
            try:
                started = await start_server(*args, **kwargs)
            except RuntimeError as error:
                if not _address_in_use(error) or time.monotonic() >= deadline:
                    raise
                if not waited:
                    logger.warning("direct ingress: %s; waiting up to %.0f s for the port", error, wait_s)
                    waited = True
                await asyncio.sleep(interval_s)
                continue
            if waited:
                logger.info("direct ingress: the port was released; serving")
            return started

    start.__wrapped__ = start_server  # type: ignore[attr-defined]
    return start


def make_direct_ingress_restartable() -> bool:
    """Install both changes in this process (idempotent). False when Ray Serve's internals are not where
    this expects them, which the unit test catches before a release; the replica then serves as Serve
    would, without the protection."""
    try:
        from ray.serve._private import http_util, replica
    except ImportError:
        logger.warning("direct ingress: Ray Serve's replica module moved; no restart protection")
        return False
    current = getattr(replica, "start_asgi_http_server", None)
    sockets = getattr(http_util, "socket", None)
    if current is None or not isinstance(sockets, ModuleType | _AddressReusingSocketModule):
        logger.warning("direct ingress: Ray Serve's HTTP helper changed; no restart protection")
        return False
    if isinstance(sockets, ModuleType):
        http_util.socket = _AddressReusingSocketModule(sockets)  # type: ignore[attr-defined,assignment]
    if not hasattr(current, "__wrapped__"):
        replica.start_asgi_http_server = waiting_for_the_port(current)  # type: ignore[attr-defined,assignment]
    return True

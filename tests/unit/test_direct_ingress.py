"""The ingress replica's own HTTP server (direct ingress) binds its port again after its predecessor died
with connections open, through Ray Serve's own server helper, as the replica's start-up calls it."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from ray.serve._private import http_util, replica
from ray.serve.config import HTTPOptions

from serve_app.deployments.direct_ingress import make_direct_ingress_restartable, waiting_for_the_port
from serve_app.launch.embedded import free_port


@pytest.fixture
def restartable(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Ray Serve's start_asgi_http_server as the ingress replica calls it once the protection is in;
    Ray's modules are put back afterwards."""
    monkeypatch.setattr(http_util, "socket", vars(http_util)["socket"])
    monkeypatch.setattr(replica, "start_asgi_http_server", vars(replica)["start_asgi_http_server"])
    assert make_direct_ingress_restartable()
    assert make_direct_ingress_restartable()  # a second replica constructor in the process: no double wrap
    start = vars(replica)["start_asgi_http_server"]
    assert start.__wrapped__ is not None and not hasattr(start.__wrapped__, "__wrapped__")
    yield start


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _get_and_leave_closed_by_server(port: int) -> bytes:
    """One request that asks the server to close the connection after its answer: the server closes
    first, so the server's side of the connection stays in TIME_WAIT on `port` after it is gone."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def _plain_bind_refused(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


async def _serve_once(start: Any, port: int) -> None:
    loop = asyncio.get_running_loop()
    task, server = await start(_app, HTTPOptions(host="127.0.0.1", port=port), event_loop=loop)
    for _ in range(3000):  # uvicorn's Server says it has started only through this flag
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started
    answer = await asyncio.to_thread(_get_and_leave_closed_by_server, port)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
    server.should_exit = True
    await task


def test_a_new_server_binds_over_the_connections_its_predecessor_left(restartable: Any) -> None:
    port = free_port()
    asyncio.run(_serve_once(restartable, port))
    # The precondition that made the outage: the port cannot be bound the way Ray binds it.
    assert _plain_bind_refused(port), "no connection left in TIME_WAIT: the test would prove nothing"
    asyncio.run(_serve_once(restartable, port))
    asyncio.run(_serve_once(restartable, port))


def test_a_port_still_listened_on_is_waited_for(restartable: Any) -> None:
    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # The old replica of a service stopped a moment ago lets go of the port while the new one waits.
        loop.call_later(0.5, holder.close)
        await _serve_once(restartable, port)

    asyncio.run(main())


def test_a_port_kept_by_another_program_still_fails_as_serve_expects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_util, "socket", vars(http_util)["socket"])
    assert make_direct_ingress_restartable()
    start = waiting_for_the_port(http_util.start_asgi_http_server, wait_s=0.3, interval_s=0.05)
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()

        async def main() -> None:
            loop = asyncio.get_running_loop()
            await start(_app, HTTPOptions(host="127.0.0.1", port=port), event_loop=loop)

        with pytest.raises(RuntimeError) as raised:
            asyncio.run(main())
    # Serve's replica reads the cause to decide that the port is taken by someone else.
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.EADDRINUSE


def test_other_failures_are_not_retried() -> None:
    calls = 0

    async def broken(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("not a bind failure")

    async def main() -> None:
        await waiting_for_the_port(broken, wait_s=5)()

    with pytest.raises(RuntimeError, match="not a bind failure"):
        asyncio.run(main())
    assert calls == 1

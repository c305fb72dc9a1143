"""The API's edge against a real redis-server (issue 10): identifiers that name internal keys, backend text
in responses. The ingress app runs in-process over the real Redis stores (no Ray: only the ingress is
involved), on an embedded redis-server bound to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import re
import socket
import stat
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis import asyncio as redis_asyncio
from redis import exceptions as redis_exceptions

from serve_app.api.app import create_app
from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.launch.embedded import EmbeddedRedis, EmbeddedServices
from serve_app.settings import AuthSettings, HttpSettings, MilvusSettings, RedisSettings, Settings
from serve_app.stores.redis_support import connect_redis
from serve_app.wiring.api import build_api_services
from serve_app.wiring.stores import redis_stores
from tests.backend_text import assert_no_backend_text
from tests.unit.fakes import solid_png

# The values of the report, and others that spell internal key names or are merely not of the issued form.
HOSTILE_REFERENCE_IDS = [
    "counts",
    "queue",
    "done:x",
    "tx:counts",
    "sys:tx-queue",
    "txn-done:0123456789abcdef0123456789abcdef",
    "../../etc/passwd",
    "0123456789ABCDEF0123456789ABCDEF",  # upper case: never issued
    "0123456789abcdef0123456789abcde",  # 31 digits
    "0123456789abcdef0123456789abcdef0",  # 33 digits
    "*",
    "0123456789abcdef0123456789abcde\n",
]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("edge"), milvus=False)
    services.start()
    try:
        yield services
    finally:
        services.stop()


def settings_for(server: EmbeddedServices, tmp_path: Path, **auth: int) -> Settings:
    return Settings(
        data_dir=tmp_path,
        blob_dir=tmp_path / "blobs",
        redis=RedisSettings(url=server.redis_url, key_prefix=f"e{tmp_path.name[-6:]}:"),
        milvus=MilvusSettings(uri=None, token=""),
        auth=AuthSettings(secret_key="edge-test-secret-0123456789abcdefghijklmnopqrstuvwxyz").model_copy(
            update=auth
        ),
        http=HttpSettings(public_base_url=None),
    )


@dataclass
class Edge:
    http: httpx.AsyncClient
    settings: Settings
    client_id: str
    client_secret: str
    token: str


@asynccontextmanager
async def edge(settings: Settings, peer: str = "127.0.0.1") -> AsyncIterator[Edge]:
    app = create_app(build_api_services(settings))
    info, secret = await redis_stores(settings).clients.create("edge-tests")
    transport = httpx.ASGITransport(app=app, client=(peer, 40000), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as http:
        login = await http.post(
            "/request-access-token", json={"client_id": info.client_id, "client_secret": secret}
        )
        assert login.status_code == 200, login.text
        token = login.json()["result"]["data"]["token"]
        yield Edge(http, settings, info.client_id, secret, token)


async def create_search(e: Edge) -> str:
    response = await e.http.post(
        "/face-search",
        headers={"Authorization": f"Bearer {e.token}"},
        data={"type": "face_search", "client_reference": "edge-subject"},
        files={"file": ("a.png", solid_png((10, 200, 30)), "image/png")},
    )
    assert response.status_code == 200, response.text
    return str(response.json()["result"]["data"]["reference_id"])


# -- item 1: identifiers are checked against their issued format; key families do not overlap ---------------


def test_result_with_internal_key_names_is_422_not_500_or_503(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with edge(settings_for(redis_server, tmp_path)) as e:
            reference_id = await create_search(e)  # the counts hash and the queue stream exist now
            headers = {"Authorization": f"Bearer {e.token}"}
            for value in HOSTILE_REFERENCE_IDS:
                response = await e.http.post("/result", headers=headers, json={"reference_id": value})
                assert response.status_code == 422, (value, response.text)
                body = response.json()
                assert body["status"] is False and set(body["errors"]) == {"reference_id"}, body
                assert_no_backend_text(response.text)
            # The issued form still works.
            ok = await e.http.post("/result", headers=headers, json={"reference_id": reference_id})
            assert ok.status_code == 202, ok.text

    asyncio.run(scenario())


def test_login_with_a_client_id_not_of_the_issued_form_is_422(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with edge(settings_for(redis_server, tmp_path)) as e:
            for value in ["counts", "clients", "cl_x", "CL_" + "a" * 24, e.client_id + "0", e.client_id[:-1]]:
                response = await e.http.post(
                    "/request-access-token", json={"client_id": value, "client_secret": e.client_secret}
                )
                assert response.status_code == 422, (value, response.text)
                assert set(response.json()["errors"]) == {"client_id"}

    asyncio.run(scenario())


def test_every_redis_key_belongs_to_exactly_one_documented_family(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    """The layout in the store docstrings: a user-valued family's prefix is never the start of another key."""

    async def scenario() -> None:
        settings = settings_for(redis_server, tmp_path)
        p = re.escape(settings.redis.key_prefix)
        async with edge(settings) as e:
            reference_id = await create_search(e)
            stores = redis_stores(settings)
            await stores.transactions.complete(reference_id, FaceSearchOutcome(is_face_found=False))
            families = {
                "txn": rf"{p}txn:[0-9a-f]{{32}}",
                "txn-done": rf"{p}txn-done:[0-9a-f]{{32}}",
                "sys": rf"{p}sys:(tx-queue|tx-counts|tx-finished|tx-consumers)",
                "client": rf"{p}client:cl_[0-9a-f]{{24}}",
                "client-secret": rf"{p}client-secret:[0-9a-f]{{64}}",
                "clients": rf"{p}clients",
                "rl": rf"{p}rl:[0-9a-f]{{64}}",
            }
            redis = connect_redis(str(settings.redis.url))
            try:
                keys = [key async for key in redis.scan_iter(match=f"{settings.redis.key_prefix}*")]
            finally:
                await redis.aclose()
            assert {
                f"{settings.redis.key_prefix}sys:tx-queue",
                f"{settings.redis.key_prefix}sys:tx-counts",
            } <= set(keys)
            for key in keys:
                matching = [name for name, pattern in families.items() if re.fullmatch(pattern, key)]
                assert len(matching) == 1, (key, matching)
            # The store treats values that are not issued reference ids as unknown, whatever they spell.
            for value in HOSTILE_REFERENCE_IDS:
                assert await stores.transactions.get(value) is None, value
            assert await stores.transactions.count_by_state() == {
                "queued": 0,
                "processing": 0,
                "completed": 1,
                "failed": 0,
            }

    asyncio.run(scenario())


# -- item 3: no backend text in any response --------------------------------------------------------------


def test_backend_failures_answer_a_fixed_message_and_log_the_details(
    redis_server: EmbeddedServices, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Real Redis failures: a WRONGTYPE reply (an internal key of the wrong type), then the server down."""

    async def scenario() -> None:
        settings = settings_for(redis_server, tmp_path)
        async with edge(settings) as e:
            headers = {"Authorization": f"Bearer {e.token}"}
            reference_id = await create_search(e)
            redis = connect_redis(str(settings.redis.url))
            try:
                # A transaction hash that is a string: HGETALL answers WRONGTYPE.
                await redis.delete(f"{settings.redis.key_prefix}txn:{reference_id}")
                await redis.set(f"{settings.redis.key_prefix}txn:{reference_id}", "not a hash")
            finally:
                await redis.aclose()
            with caplog.at_level("WARNING"):
                wrongtype = await e.http.post("/result", headers=headers, json={"reference_id": reference_id})
            assert wrongtype.status_code == 503, wrongtype.text
            assert wrongtype.json()["message"] == BackendUnavailable.public_message
            assert_no_backend_text(wrongtype.text)
            assert any(
                "WRONGTYPE" in record.getMessage() and reference_id in record.getMessage()
                for record in caplog.records
            ), [record.getMessage() for record in caplog.records]

    asyncio.run(scenario())


def test_redis_down_answers_a_fixed_message_without_host_port_or_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedServices(tmp_path / "down", milvus=False)
    server.start()
    assert server.redis is not None
    port = server.redis.port

    async def scenario() -> None:
        settings = settings_for(server, tmp_path)
        async with edge(settings) as e:
            headers = {"Authorization": f"Bearer {e.token}"}
            reference_id = await create_search(e)
            await asyncio.to_thread(server.stop)
            calls = {
                "result": e.http.post("/result", headers=headers, json={"reference_id": reference_id}),
                "login": e.http.post(
                    "/request-access-token", json={"client_id": e.client_id, "client_secret": e.client_secret}
                ),
                "face-search": e.http.post(
                    "/face-search",
                    headers=headers,
                    data={"type": "face_search"},
                    files={"file": ("a.png", solid_png((1, 2, 3)), "image/png")},
                ),
                "client-secret": e.http.post(
                    "/result", headers={"Client-Secret": e.client_secret}, json={"reference_id": reference_id}
                ),
            }
            with caplog.at_level("WARNING"):
                for name, call in calls.items():
                    response = await call
                    assert response.status_code == 503, (name, response.text)
                    assert response.json() == {
                        "status": False,
                        "message": BackendUnavailable.public_message,
                        "errors": {},
                    }
                    assert_no_backend_text(response.text, ports=[port])
            logged = "\n".join(record.getMessage() for record in caplog.records)
            assert str(port) in logged  # the operator still learns what failed

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


# -- item 6: the embedded redis-server requires a generated password ---------------------------------------


def raw_command(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(256)


def test_embedded_redis_refuses_unauthenticated_clients_and_keeps_its_password_private(
    tmp_path: Path,
) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        assert server.pid is not None
        password = server.password()
        assert len(password) >= 32
        assert stat.S_IMODE(server.password_path.stat().st_mode) == 0o600
        for path in server.data_dir.iterdir():
            if path.is_file() and password in path.read_text(errors="replace"):
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        # Not on the command line, which any local user can read.
        assert password not in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")

        assert raw_command(server.port, b"PING\r\n").startswith(b"-NOAUTH")
        assert raw_command(server.port, b"AUTH wrong-password\r\n").startswith(b"-WRONGPASS")
        assert raw_command(server.port, b"CONFIG GET protected-mode\r\n").startswith(b"-NOAUTH")

        async def clients() -> None:
            anonymous = redis_asyncio.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
            try:
                with pytest.raises(redis_exceptions.AuthenticationError):
                    await anonymous.ping()
            finally:
                await anonymous.aclose()
            authenticated = connect_redis(server.url)
            try:
                assert await authenticated.ping() is True
                assert await authenticated.config_get("protected-mode") == {"protected-mode": "yes"}
            finally:
                await authenticated.aclose()

        asyncio.run(clients())

        # A restart reuses the password file: clients configured with the URL keep working.
        url = server.url
        server.stop()
        server.start()
        assert server.password() == password and server.url == url
        assert raw_command(server.port, f"AUTH {password}\r\nPING\r\n".encode()).startswith(b"+OK\r\n")
        # A second launcher on the same data directory attaches with the same credentials.
        second = EmbeddedRedis(tmp_path / "redis")
        second.start()
        assert not second.owned and second.url == url
    finally:
        server.stop()


# -- item 4: login throttling that cannot be turned against the client ---------------------------------------


def test_fifty_parallel_bad_logins_cannot_exceed_the_allowance(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    async def scenario() -> None:
        settings = settings_for(redis_server, tmp_path, login_failures_per_window=10)
        async with edge(settings, peer="203.0.113.7") as e:
            attempts = [
                e.http.post(
                    "/request-access-token", json={"client_id": e.client_id, "client_secret": f"guess-{n}"}
                )
                for n in range(50)
            ]
            responses = await asyncio.gather(*attempts)
            statuses = sorted(response.status_code for response in responses)
            assert statuses.count(401) == 10, statuses
            assert statuses.count(429) == 40, statuses
            # The store-level step alone, in parallel too: exactly the allowance goes ahead.
            limiter = redis_stores(settings).limiter
            waits = await asyncio.gather(
                *(limiter.attempt("parallel-probe", 10, 1.0, 60.0, 300.0) for _ in range(50))
            )
            assert sorted(waits).count(0) == 10 and all(wait >= 1 for wait in waits if wait)

    asyncio.run(scenario())


def test_an_attackers_failures_do_not_stop_the_client_from_its_own_address(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    async def scenario() -> None:
        settings = settings_for(redis_server, tmp_path, login_failures_per_window=10)
        async with edge(settings, peer="198.51.100.20") as client:
            transport = httpx.ASGITransport(
                app=create_app(build_api_services(settings)), client=("203.0.113.7", 40000)
            )
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as attacker:
                body = {"client_id": client.client_id, "client_secret": "wrong"}
                statuses = [
                    (await attacker.post("/request-access-token", json=body)).status_code for _ in range(30)
                ]
                assert statuses.count(401) == 10 and statuses.count(429) == 20, statuses
                # Rotating X-Forwarded-For does not help: no proxy is trusted, so the header is ignored.
                spoofed = await attacker.post(
                    "/request-access-token", json=body, headers={"X-Forwarded-For": "192.0.2.77"}
                )
                assert spoofed.status_code == 429
            ok = await client.http.post(
                "/request-access-token",
                json={"client_id": client.client_id, "client_secret": client.client_secret},
            )
            assert ok.status_code == 200, ok.text

    asyncio.run(scenario())

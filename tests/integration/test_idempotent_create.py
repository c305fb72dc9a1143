"""Idempotent creates against a real redis-server (issue 35, item 1): the ingress app runs in-process over
the real Redis stores (no Ray: only the ingress is involved), talking to Redis through a proxy that can
lose the reply of the create script after Redis ran it, and with WAIT 1 on a master whose replica is
attached only later. Retried with one Idempotency-Key (as the Python client retries 503), each ends in
exactly one transaction; the end-to-end run with a worker enrolling the face is in
tests/integration/faults/test_idempotent_enrolment.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from PIL import Image

from facesearch_client import calls
from facesearch_client._policy import RetryPolicy
from facesearch_client.aio import AsyncFaceSearchClient
from serve_app.api.app import create_app
from serve_app.domain.transactions import upload_key
from serve_app.launch.embedded import EmbeddedRedis, EmbeddedServices, free_port
from serve_app.settings import (
    AuthSettings,
    HttpSettings,
    LimitSettings,
    MilvusSettings,
    RedisSettings,
    Settings,
)
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_support import connect_redis
from serve_app.wiring.api import build_api_services
from serve_app.wiring.stores import redis_stores


def solid_png(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buffer, "PNG")
    return buffer.getvalue()


HANG_GUARD_S = 60.0  # hang guard only: a replica attaches in well under a second on loopback


class ReplyDropper:
    """A TCP proxy in front of Redis. While `drops` is above 0, a command that carries `marker` reaches
    Redis and runs there, but its reply is lost: the proxy closes the client's connection instead of
    passing the reply on (what a network fault between Redis and the ingress does). With `before_redis`
    the connection is closed before the command reaches Redis instead."""

    def __init__(self, upstream_port: int, marker: bytes, *, before_redis: bool = False) -> None:
        self.upstream_port = upstream_port
        self.marker = marker
        self.before_redis = before_redis
        self.drops = 0
        self.dropped = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        doomed = asyncio.Event()

        async def upstream() -> None:
            while data := await reader.read(65536):
                if self.drops > 0 and self.marker in data:
                    self.drops -= 1
                    doomed.set()
                    if self.before_redis:
                        self.dropped += 1
                        return
                up_writer.write(data)
                await up_writer.drain()

        async def downstream() -> None:
            while data := await up_reader.read(65536):
                if doomed.is_set():
                    self.dropped += 1
                    break  # Redis has answered, so it ran the command: the reply goes nowhere
                writer.write(data)
                await writer.drain()

        try:
            await asyncio.wait(
                [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())],
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for stream in (writer, up_writer):
                stream.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("idempotency"), milvus=False)
    services.start()
    try:
        yield services
    finally:
        services.stop()


def settings_for(redis_url: str, tmp_path: Path, wait_replicas: int = 0) -> Settings:
    return Settings(
        limits=LimitSettings(wait_for_result_timeout_s=0.5),
        data_dir=tmp_path,
        blob_dir=tmp_path / "blobs",
        redis=RedisSettings(
            url=redis_url,
            key_prefix=f"i{tmp_path.name[-6:]}:",
            wait_replicas=wait_replicas,
            wait_timeout_ms=200,
        ),
        milvus=MilvusSettings(uri=None, token=""),
        auth=AuthSettings(secret_key="idempotency-test-secret-0123456789abcdefghijklmnopqrstuvw"),
        http=HttpSettings(public_base_url=None),
    )


@dataclass
class Ingress:
    client: AsyncFaceSearchClient
    client_id: str


@asynccontextmanager
async def ingress(
    settings: Settings, retries: int, credentials: tuple[str, str] | None = None
) -> AsyncIterator[Ingress]:
    """The ingress app in-process and the Python client on it, retrying 503 `retries` times at once;
    credentials: the (client_id, secret) to use, default a new client."""
    app = create_app(build_api_services(settings))
    if credentials is None:
        info, secret = await redis_stores(settings).clients.create("idempotency-tests")
        credentials = (info.client_id, secret)
    client_id, secret = credentials
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as http:
        client = AsyncFaceSearchClient(
            client_id=client_id,
            client_secret=secret,
            http=http,
            retry=RetryPolicy(max_retries=retries, base_s=0.0, max_wait_s=0.0),
        )
        yield Ingress(client, client_id)


async def transactions_created(settings: Settings, direct_url: str) -> tuple[int, int, int]:
    """(transactions counted by state, entries on the work queue, blobs on disk), read from the real
    stores directly (not through the proxy)."""
    redis = connect_redis(direct_url)
    try:
        store = redis_stores(settings, redis).transactions
        counted = sum((await store.count_by_state()).values())
        queued = await store.depth()
    finally:
        await redis.aclose()
    blobs = [path for path in settings.blobs.rglob("*") if path.is_file() and not path.suffix]
    return counted, queued, len(blobs)


async def upload_of(settings: Settings, tenant_id: str, reference_id: str) -> bytes | None:
    found = await LocalBlobStore(settings.blobs).get(upload_key(tenant_id, reference_id))
    return found[0] if found is not None else None


def proxied(url: str, port: int) -> str:
    """The Redis URL with the proxy's port in place of the server's."""
    head, _, tail = url.rpartition("@")
    return f"{head}@127.0.0.1:{port}/{tail.split('/', 1)[1]}"


@pytest.mark.parametrize("lost_replies", [1, 4])
def test_a_lost_reply_of_the_create_script_makes_one_transaction(
    redis_server: EmbeddedServices, tmp_path: Path, lost_replies: int
) -> None:
    """1: redis-py resends the script on a new connection and the call succeeds; 4: redis-py's retries
    (2) are spent too, the ingress answers 503 and the client's retry (same key) gets the transaction."""
    server = redis_server.redis
    assert server is not None

    async def main() -> None:
        proxy = ReplyDropper(server.port, b"sys:tx-queue")  # only the create script names the queue
        port = await proxy.start()
        settings = settings_for(proxied(server.url, port), tmp_path)
        try:
            async with ingress(settings, retries=3) as api:
                await api.client.login()
                proxy.drops = lost_replies
                image = solid_png((200, 40, 40))
                call = calls.face_search(image, client_reference="subject-1")
                response = await api.client.send(call)
                assert response.status_code == 200, response.text
                reference_id = response.json()["result"]["data"]["reference_id"]
                assert proxy.dropped == lost_replies
                assert await transactions_created(settings, server.url) == (1, 1, 1)
                assert await upload_of(settings, api.client_id, reference_id) == image
                # The transaction read back is the one the answer named.
                assert (await api.client.result(reference_id)).reference_id == reference_id
        finally:
            await proxy.stop()

    asyncio.run(main())


def test_age_estimation_whose_wait_fails_after_the_create_is_retried_into_the_same_transaction(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    """wait_for_result=1: the transaction is created, then the wait for its result loses its Redis
    connection (every resend too) and the request answers 503. The client's retry with the same key is
    answered with that transaction (202: no worker runs here), and nothing else was created."""
    server = redis_server.redis
    assert server is not None

    async def main() -> None:
        proxy = ReplyDropper(server.port, b"txn-done:", before_redis=True)  # only waits name the signal
        port = await proxy.start()
        settings = settings_for(proxied(server.url, port), tmp_path)
        try:
            async with ingress(settings, retries=1) as api:
                await api.client.login()
                proxy.drops = 3  # the wait and redis-py's two resends: the first request's wait fails
                call = calls.age_estimation(solid_png((40, 40, 200)), enroll_face=False, wait_for_result=True)
                response = await api.client.send(call)
                assert proxy.dropped == 3
                assert response.status_code == 202, response.text
                reference_id = response.json()["result"]["data"]["reference_id"]
                assert await transactions_created(settings, server.url) == (1, 1, 1)
                assert (await api.client.result(reference_id)).reference_id == reference_id
        finally:
            await proxy.stop()

    asyncio.run(main())


def test_a_key_reused_for_another_request_is_refused_with_the_envelope(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    server = redis_server.redis
    assert server is not None

    async def main() -> None:
        settings = settings_for(server.url, tmp_path)
        async with ingress(settings, retries=0) as api:
            await api.client.login()
            first = calls.face_search(
                solid_png((1, 2, 3)), client_reference="subject-3", idempotency_key="k-1"
            )
            assert (await api.client.send(first)).status_code == 200
            for changed in (
                calls.face_search(solid_png((1, 2, 4)), client_reference="subject-3", idempotency_key="k-1"),
                calls.face_search(solid_png((1, 2, 3)), client_reference="subject-4", idempotency_key="k-1"),
                calls.age_estimation(solid_png((1, 2, 3)), idempotency_key="k-1"),
            ):
                refused = await api.client.send(changed)
                assert refused.status_code == 422, refused.text
                assert refused.json() == {
                    "status": False,
                    "message": "The Idempotency-Key was already used for a different request.",
                    "errors": {"Idempotency-Key": "used for a different request"},
                }
            malformed = dataclasses.replace(first, headers={"Idempotency-Key": "k" * 256})
            assert (await api.client.send(malformed)).status_code == 422
            assert await transactions_created(settings, server.url) == (1, 1, 1)

    asyncio.run(main())


@contextlib.contextmanager
def replica_of(master: EmbeddedRedis, root: Path) -> Iterator[None]:
    """A redis-server replicating `master` (on loopback, with the master's password), until the block
    ends; returns once the master counts it as an online replica."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    config = root / "replica.conf"
    password = master.password()
    config.write_text(
        f"port {port}\nbind 127.0.0.1\nrequirepass {password}\nmasterauth {password}\ndir {root}\n"
        f'save ""\nappendonly no\nreplicaof 127.0.0.1 {master.port}\n'
    )
    log = (root / "replica.log").open("ab")
    process = subprocess.Popen([EmbeddedRedis.binary(), str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        with redis.Redis.from_url(master.url) as watcher:
            deadline = time.monotonic() + HANG_GUARD_S
            while watcher.info("replication").get("slave0", {}).get("state") != "online":
                assert time.monotonic() < deadline, "the replica never came online"
                time.sleep(0.05)
        yield
    finally:
        process.terminate()
        process.wait(HANG_GUARD_S)


def test_a_create_short_of_its_replicas_is_retried_into_the_same_transaction(tmp_path: Path) -> None:
    """WAIT 1 with no replica: the create is written on the master but answered 503, and so is its retry;
    once a replica is attached, the retry with the same key is answered with the first transaction's
    reference_id (its WAIT now covers the first write too) and nothing new exists."""
    services = EmbeddedServices(tmp_path / "backends", milvus=False)
    services.start()
    master = services.redis
    assert master is not None
    settings = settings_for(master.url, tmp_path, wait_replicas=1)
    image = solid_png((40, 200, 40))
    call = calls.face_search(image, client_reference="subject-2")

    async def new_client() -> tuple[str, str]:
        info, secret = await redis_stores(settings).clients.create("idempotency-tests")
        return info.client_id, secret

    async def attempt(retries: int) -> httpx.Response:
        async with ingress(settings, retries=retries, credentials=credentials) as api:
            return await api.client.send(call)

    try:
        credentials = asyncio.run(new_client())
        # The client retries 503 (here twice, at once): every attempt falls short of the replica.
        short = asyncio.run(attempt(2))
        assert short.status_code == 503, short.text
        assert asyncio.run(transactions_created(settings, master.url)) == (1, 1, 1)
        with replica_of(master, tmp_path / "replica"):
            answered = asyncio.run(attempt(0))
            assert answered.status_code == 200, answered.text
            reference_id = answered.json()["result"]["data"]["reference_id"]
            assert asyncio.run(transactions_created(settings, master.url)) == (1, 1, 1)
            assert asyncio.run(upload_of(settings, credentials[0], reference_id)) == image
    finally:
        services.stop()


def test_openapi_documents_the_header_on_both_creates(redis_server: EmbeddedServices, tmp_path: Path) -> None:
    server = redis_server.redis
    assert server is not None

    async def main() -> dict[str, Any]:
        transport = httpx.ASGITransport(
            app=create_app(build_api_services(settings_for(server.url, tmp_path)))
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            return dict((await http.get("/openapi.json")).json())

    paths = asyncio.run(main())["paths"]
    for path in ("/face-search", "/age-estimation"):
        (header,) = [p for p in paths[path]["post"]["parameters"] if p["name"] == "Idempotency-Key"]
        assert header["in"] == "header" and not header.get("required", False)
        assert "retry" in header["description"]


def test_concurrent_requests_with_one_key_create_one_transaction(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    server = redis_server.redis
    assert server is not None

    async def main() -> None:
        settings = settings_for(server.url, tmp_path)
        async with ingress(settings, retries=0) as api:
            await api.client.login()
            call = calls.face_search(solid_png((9, 9, 9)), client_reference="subject-5")
            answers = await asyncio.gather(*(api.client.send(call) for _ in range(6)))
            assert {answer.status_code for answer in answers} == {200}
            references = {answer.json()["result"]["data"]["reference_id"] for answer in answers}
            assert len(references) == 1
            assert await transactions_created(settings, server.url) == (1, 1, 1)

    asyncio.run(main())


def test_a_key_lives_for_its_own_ttl_not_the_transaction_retention(
    redis_server: EmbeddedServices, tmp_path: Path
) -> None:
    """Keys are bookkeeping that every keyed create adds: by default their record lapses after 24 h while
    the transaction it names stays for the 30-day retention, and once a key has lapsed the same key makes
    a new transaction (a retry a day later is a new request)."""
    server = redis_server.redis
    assert server is not None

    async def main() -> None:
        settings = settings_for(server.url, tmp_path)
        assert settings.retention.transaction_retention_s == 30 * 24 * 3600
        direct = connect_redis(server.url)
        try:
            async with ingress(settings, retries=0) as api:
                await api.client.login()
                call = calls.face_search(solid_png((7, 7, 7)), client_reference="subject-6")
                assert (await api.client.send(call)).status_code == 200
                (record,) = [key async for key in direct.scan_iter(f"{settings.redis.key_prefix}idem:*")]
                assert 24 * 3600 - 60 <= await direct.ttl(record) <= 24 * 3600

            short = settings.model_copy(
                update={"retention": settings.retention.model_copy(update={"idempotency_key_ttl_s": 1})}
            )
            async with ingress(short, retries=0) as api:
                await api.client.login()
                call = calls.age_estimation(solid_png((8, 8, 8)), idempotency_key="k-lapse")
                first = (await api.client.send(call)).json()["result"]["data"]["reference_id"]
                assert (await api.client.send(call)).json()["result"]["data"]["reference_id"] == first
                await asyncio.sleep(2.1)
                again = (await api.client.send(call)).json()["result"]["data"]["reference_id"]
                assert again != first
        finally:
            await direct.aclose()

    asyncio.run(main())

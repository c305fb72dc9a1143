"""Contract tests: each store interface of serve_app/stores/interfaces.py, run against the unit tests' fake
(tests/unit/fakes/) and against the real store on real servers (redis-server and milvus-lite started by
serve_app.launch.embedded, bound to 127.0.0.1; the file blob store in a temporary directory).

A test here asserts what the interface's docstrings promise, so a fake that drifts from the real store
fails the same test the real store passes. Each parametrised fixture below gives an `Opener`: called
inside the test's event loop, it yields a fresh, empty store (own key prefix, own collection, own
directory), so tests never share state through the session's servers. The real side carries the
`real_stores` marker: `pytest -m "not real_stores"` runs the fake side alone, without starting a server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis

from serve_app.domain.keys import WEBHOOK_SECRETS, KeyRing
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.launch.embedded import EmbeddedMilvus, EmbeddedRedis
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import (
    AuditLog,
    BlobStore,
    ClientStore,
    FaceRecordStore,
    GalleryStore,
    RateLimiter,
    RequestAdmission,
    TransactionStore,
    WebhookStore,
    WorkQueue,
)
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.redis_webhooks import RedisWebhookStore, SecretCipher
from tests.unit.fakes import (
    EMBEDDING_SIZE,
    TEST_POLICY,
    FakeAuditLog,
    FakeBlobStore,
    FakeClientStore,
    FakeFaceRecordStore,
    FakeGalleryStore,
    FakeRateLimiter,
    FakeRequestAdmission,
    FakeTransactionStore,
    FakeWebhookStore,
)

T = TypeVar("T")
Opener = Callable[[], AbstractAsyncContextManager[T]]

SIDES = ["fake", pytest.param("real", marks=pytest.mark.real_stores)]
MODEL_VERSION = TEST_POLICY.model_version
# Hang guard, not a speed bound: every real call has its own deadline of seconds (socket timeouts, Milvus'
# timeout_s); this only turns a hang into a failure.
HANG_GUARD_S = 60.0


def run_with(opener: Opener[T], scenario: Callable[[T], Awaitable[None]]) -> None:
    """Run the scenario against a fresh store, in an event loop of its own."""

    async def main() -> None:
        async with opener() as store:
            await asyncio.wait_for(scenario(store), HANG_GUARD_S)

    asyncio.run(main())


def make_tx(**changes: Any) -> Transaction:
    """A queued face search (the client reference quoted, to reach the stores' escaping); `changes` override
    any field."""
    now = time.time()
    fields: dict[str, Any] = {
        "reference_id": new_reference_id(),
        "tenant_id": "tenant-a",
        "kind": TransactionKind.FACE_SEARCH,
        "state": TransactionState.QUEUED,
        "created_at": now,
        "updated_at": now,
        "image_key": f"uploads/{uuid.uuid4().hex}",
        "enroll_face": True,
        "allow_override": True,
        "client_reference": 'ref "quoted" \\ back',
    }
    fields.update(changes)
    return Transaction(**fields)


# ------------------------------------------------------------------------------------------ servers


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("contracts") / "redis")
    with server:
        yield server.url


@pytest.fixture(scope="session")
def milvus_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedMilvus(tmp_path_factory.mktemp("contracts") / "milvus")
    with server:
        yield server.uri


@asynccontextmanager
async def _redis(url: str) -> AsyncIterator[tuple[Redis, str]]:
    """A client of this event loop and a key prefix no other test uses."""
    client = connect_redis(url)
    try:
        yield client, f"c{uuid.uuid4().hex[:8]}:"
    finally:
        await client.aclose()


def _side(request: pytest.FixtureRequest, server: str) -> str | None:
    """The server address for the real side (starting the session's server on first use), None for the
    fake side."""
    if request.param == "fake":
        return None
    return str(request.getfixturevalue(server))


def _redis_opener(url: str | None, fake: Callable[[], T], real: Callable[[Redis, str], T]) -> Opener[T]:
    @asynccontextmanager
    async def opener() -> AsyncIterator[T]:
        if url is None:
            yield fake()
            return
        async with _redis(url) as (client, prefix):
            yield real(client, prefix)

    return opener


# ------------------------------------------------------------------------------ transactions, queue


@dataclass
class QueueKit:
    """Transactions and their work queue: one Redis store on the real side, a store and its queue on the
    fake side (create_and_enqueue is how entries reach the queue)."""

    transactions: TransactionStore
    queue: WorkQueue


def _fake_queue() -> QueueKit:
    fake = FakeTransactionStore()
    return QueueKit(fake, fake.queue)


def _redis_queue(client: Redis, prefix: str) -> QueueKit:
    real = RedisTransactionStore(client, prefix)
    return QueueKit(real, real)


@pytest.fixture(params=SIDES)
def open_queue(request: pytest.FixtureRequest) -> Opener[QueueKit]:
    return _redis_opener(_side(request, "redis_url"), _fake_queue, _redis_queue)


# --------------------------------------------------------------------------------------------- webhooks


WEBHOOK_LOG_SIZE = 5


@dataclass
class WebhookKit:
    """The webhook store and the transaction store whose final writes queue its events."""

    transactions: TransactionStore
    webhooks: WebhookStore


def _fake_webhooks() -> WebhookKit:
    webhooks = FakeWebhookStore(log_size=WEBHOOK_LOG_SIZE)
    return WebhookKit(FakeTransactionStore(webhooks=webhooks), webhooks)


def _redis_webhooks(client: Redis, prefix: str) -> WebhookKit:
    cipher = SecretCipher(KeyRing.parse("k1:" + "c" * 32).for_purpose(WEBHOOK_SECRETS))
    webhooks = RedisWebhookStore(client, cipher, prefix, log_size=WEBHOOK_LOG_SIZE, event_retention_s=3600)
    return WebhookKit(RedisTransactionStore(client, prefix), webhooks)


@pytest.fixture(params=SIDES)
def open_webhooks(request: pytest.FixtureRequest) -> Opener[WebhookKit]:
    return _redis_opener(_side(request, "redis_url"), _fake_webhooks, _redis_webhooks)


# ---------------------------------------------------------------------------------- other Redis stores


PEPPER = "contract-test-pepper-0123456789"


@pytest.fixture(params=SIDES)
def open_records(request: pytest.FixtureRequest) -> Opener[FaceRecordStore]:
    return _redis_opener(_side(request, "redis_url"), FakeFaceRecordStore, RedisFaceRecordStore)


@pytest.fixture(params=SIDES)
def open_audit(request: pytest.FixtureRequest) -> Opener[AuditLog]:
    return _redis_opener(_side(request, "redis_url"), FakeAuditLog, RedisAuditLog)


@pytest.fixture(params=SIDES)
def open_clients(request: pytest.FixtureRequest) -> Opener[ClientStore]:
    return _redis_opener(
        _side(request, "redis_url"),
        FakeClientStore,
        lambda client, prefix: RedisClientStore(client, PEPPER, prefix),
    )


@pytest.fixture(params=SIDES)
def open_limiter(request: pytest.FixtureRequest) -> Opener[RateLimiter]:
    return _redis_opener(_side(request, "redis_url"), FakeRateLimiter, RedisRateLimiter)


@dataclass
class AdmissionKit:
    """RequestAdmission with the client store and limiter it shares its state with."""

    clients: ClientStore
    limiter: RateLimiter
    admission: RequestAdmission


def _fake_admission() -> AdmissionKit:
    clients, limiter = FakeClientStore(), FakeRateLimiter()
    return AdmissionKit(clients, limiter, FakeRequestAdmission(clients, limiter))


@pytest.fixture(params=SIDES)
def open_admission(request: pytest.FixtureRequest) -> Opener[AdmissionKit]:
    return _redis_opener(
        _side(request, "redis_url"),
        _fake_admission,
        lambda client, prefix: AdmissionKit(
            RedisClientStore(client, PEPPER, prefix),
            RedisRateLimiter(client, prefix),
            RedisRequestAdmission(client, prefix),
        ),
    )


# ---------------------------------------------------------------------------------- gallery, blobs


@pytest.fixture(params=SIDES)
def open_gallery(request: pytest.FixtureRequest) -> Opener[GalleryStore]:
    uri = _side(request, "milvus_uri")

    @asynccontextmanager
    async def opener() -> AsyncIterator[GalleryStore]:
        if uri is None:
            yield FakeGalleryStore(model_version=MODEL_VERSION)
            return
        collection = f"contract_{uuid.uuid4().hex[:8]}"
        store = MilvusGalleryStore(uri, collection, model_version=MODEL_VERSION, dimension=EMBEDDING_SIZE)
        try:
            yield store
        finally:
            await store.close()
            await asyncio.to_thread(_drop_collection, uri, f"{collection}_{MODEL_VERSION}")

    return opener


def _drop_collection(uri: str, name: str) -> None:
    from pymilvus import MilvusClient

    client: Any = MilvusClient(uri=uri, timeout=10.0)
    try:
        client.drop_collection(name.replace("-", "_"), timeout=10.0)
    finally:
        client.close()


@pytest.fixture(params=SIDES)
def open_blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Opener[BlobStore]:
    real = request.param != "fake"

    @asynccontextmanager
    async def opener() -> AsyncIterator[BlobStore]:
        yield LocalBlobStore(tmp_path / "blobs") if real else FakeBlobStore()

    return opener

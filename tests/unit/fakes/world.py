"""Every fake store wired together, and the API over them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from models.calibration import FaceScoreCalibration
from serve_app.api.app import ApiServices, create_app
from serve_app.api.limits import parse_networks
from serve_app.api.tokens import TokenSigner
from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.stores.interfaces import LockPolicy
from tests.unit.fakes.blobs import FakeBlobStore
from tests.unit.fakes.clients import FakeClientStore, FakeRateLimiter, FakeRequestAdmission
from tests.unit.fakes.common import MODEL_VERSION, Faults, ManualClock
from tests.unit.fakes.gallery import FakeGalleryStore
from tests.unit.fakes.models import ScriptedAnalysis
from tests.unit.fakes.records import FakeFaceRecordStore
from tests.unit.fakes.transactions import FakeTransactionStore
from tests.unit.fakes.work_queue import FakeWorkQueue

# The reference lock of the tests: waits and holds long enough for any unit test, lapses fast for a dead one.
TEST_LOCK = LockPolicy(wait_s=10.0, ttl_s=2.0, max_hold_s=60.0)

TEST_POLICY = ProcessingPolicy(
    model_version=MODEL_VERSION,
    max_matches=10,
    min_score=0.5,  # fixed, so tests do not depend on gallery sizes unless they ask (min_score=None)
    max_image_pixels=40_000_000,
    analysis_max_side=1920,
    calibration=FaceScoreCalibration.load(),
    lock=TEST_LOCK,
    tenant_cache_s=0.0,
)


@dataclass
class World:
    """Every fake store, wired together as the real ones are."""

    faults: Faults = field(default_factory=Faults)
    queue_clock: ManualClock | None = None
    records: FakeFaceRecordStore | None = None
    transactions: FakeTransactionStore = field(init=False)
    queue: FakeWorkQueue = field(init=False)
    gallery: FakeGalleryStore = field(init=False)
    blobs: FakeBlobStore = field(init=False)
    analysis: ScriptedAnalysis = field(default_factory=ScriptedAnalysis)
    policy: ProcessingPolicy = TEST_POLICY
    clients: FakeClientStore = field(default_factory=FakeClientStore)

    def __post_init__(self) -> None:
        clock: Callable[[], float] = self.queue_clock if self.queue_clock is not None else time.monotonic
        self.queue = FakeWorkQueue(self.faults, clock)
        self.transactions = FakeTransactionStore(self.queue, self.faults)
        if self.records is None:
            self.records = FakeFaceRecordStore(self.faults)
        self.gallery = FakeGalleryStore(self.faults, self.policy.model_version)
        self.blobs = FakeBlobStore(self.faults)

    @property
    def record_store(self) -> FakeFaceRecordStore:
        assert self.records is not None
        return self.records

    def processor(self) -> TransactionProcessor:
        return TransactionProcessor(
            self.transactions,
            self.record_store,
            self.gallery,
            self.blobs,
            self.analysis,
            self.policy,
            clients=self.clients,
        )

    def transaction_service(self, max_image_pixels: int = 40_000_000) -> TransactionService:
        return TransactionService(self.transactions, self.blobs, max_image_pixels, records=self.record_store)

    async def enrol(
        self,
        tenant_id: str,
        face_id: str,
        vector: np.ndarray,
        client_reference: str | None = None,
        created_at: float | None = None,
        proof: bytes = b"proof-bytes",
    ) -> FaceRecord:
        """An enrolled face as a finished enrolment leaves it: record, vector and proof blob."""
        record = FaceRecord(
            face_id=face_id,
            tenant_id=tenant_id,
            client_reference=client_reference,
            proof_key=f"proofs/{tenant_id}/{face_id}",
            model_version=self.policy.model_version,
            created_at=created_at if created_at is not None else time.time() - 3600,
            reference_id=f"ref-{face_id}",
        )
        await self.blobs.put(record.proof_key, proof, "image/png")
        await self.record_store.put(record)
        await self.gallery.add(
            [
                GalleryEntry(
                    face_id=face_id,
                    tenant_id=tenant_id,
                    model_version=record.model_version,
                    embedding=vector,
                    created_at=record.created_at,
                )
            ]
        )
        return record


@dataclass
class Api:
    """The ASGI app over a World, with one registered client (the tenant of most tests)."""

    world: World
    signer: TokenSigner
    clients: FakeClientStore
    limiter: FakeRateLimiter
    auth: ClientAuthenticator
    services: ApiServices
    client_id: str
    client_secret: str

    def token(self, client_id: str | None = None) -> str:
        return self.signer.issue_access(client_id or self.client_id)[0]

    def headers(self, client_id: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(client_id)}"}

    def http(self, client: tuple[str, int] = ("127.0.0.1", 40000)) -> httpx.AsyncClient:
        # raise_app_exceptions=False: an unhandled error is seen as the 500 response a client would get.
        transport = httpx.ASGITransport(
            app=create_app(self.services), client=client, raise_app_exceptions=False
        )
        return httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=10.0)

    async def new_client(self, name: str) -> tuple[str, str]:
        info, secret = await self.clients.create(name)
        return info.client_id, secret


SERVICE_SECRET = "unit-test-service-secret-0123456789abcdefghijklmnop"


async def build_api(
    world: World | None = None,
    *,
    max_upload_bytes: int = 2 * 1024 * 1024,
    max_image_pixels: int = 40_000_000,
    wait_for_result_timeout_s: float = 0.3,
    public_base_url: str | None = None,
    login_failures_per_window: int = 3,
    login_window_s: int = 300,
    login_backoff_max_s: int = 900,
    unauthenticated_per_minute: int = 10_000,
    trusted_proxies: tuple[str, ...] = (),
    requests_per_minute: int = 10_000,
    limiter_clock: Callable[[], float] = time.time,
    access_ttl_s: int = 900,
    proof_ttl_s: int = 900,
) -> Api:
    world = world if world is not None else World()
    clients = FakeClientStore()
    limiter = FakeRateLimiter(limiter_clock)
    auth = ClientAuthenticator(
        clients,
        limiter,
        FakeRequestAdmission(clients, limiter),
        login_failures_per_window=login_failures_per_window,
        login_window_s=login_window_s,
        requests_per_minute=requests_per_minute,
        login_backoff_max_s=login_backoff_max_s,
        unauthenticated_per_minute=unauthenticated_per_minute,
    )
    signer = TokenSigner(SERVICE_SECRET, access_ttl_s=access_ttl_s, proof_ttl_s=proof_ttl_s)
    services = ApiServices(
        transactions=world.transaction_service(max_image_pixels),
        proofs=ProofService(world.record_store, world.blobs),
        auth=auth,
        signer=signer,
        max_upload_bytes=max_upload_bytes,
        wait_for_result_timeout_s=wait_for_result_timeout_s,
        public_base_url=public_base_url,
        trusted_proxies=parse_networks(trusted_proxies),
    )
    info, secret = await clients.create("tenant-a")
    return Api(world, signer, clients, limiter, auth, services, info.client_id, secret)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.002)


def assert_error_envelope(body: Any) -> None:
    assert isinstance(body, dict), body
    assert set(body) == {"status", "message", "errors"}, body
    assert body["status"] is False
    assert isinstance(body["message"], str) and body["message"]
    assert isinstance(body["errors"], dict)
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in body["errors"].items())

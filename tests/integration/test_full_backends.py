"""A full Redis and a full disk answer like a busy server, lose nothing accepted, and pass without a restart
(issue 43): on a redis-server of serve_app.launch.embedded whose maxmemory is lowered at run time, and on a
tmpfs mounted for the test as the blob and result directories.

The ingress is the real app in-process (create_app over build_api_services: real Redis stores, the local
blob store); the worker is a QueueWorker with the real TransactionProcessor over the same Redis, milvus-lite
(the session's) and the same blob directory. The analysis backend is the unit tests' scripted one, held at
a gate so the transactions are in the worker's hands when the backend fills.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from facesearch_client import AsyncFaceSearchClient
from serve_app.api.app import create_app
from serve_app.domain.errors import BackendUnavailable, StorageFull
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.processing import TransactionProcessor, enrolled_face_id
from serve_app.pipelines.result_archive import archive_finished
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import AuthSettings, HttpSettings, MilvusSettings, RedisSettings, Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_support import check_eviction_policy, connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.wiring.api import build_api_services
from serve_app.wiring.stores import RedisStores, redis_stores, result_archive
from tests.backend_text import assert_no_backend_text
from tests.contracts.conftest import make_tx
from tests.unit.fakes import EMBEDDING_SIZE, TEST_POLICY, Color, ScriptedAnalysis, embedding, face, solid_png

TENANT_NAME = "full-backends"
RED: Color = (200, 30, 30)
POLICY = WorkerPolicy(
    concurrency=4,
    stale_after_s=5.0,
    max_deliveries=2,
    claim_block_ms=50,
    reclaim_every_s=0.2,
    backoff_s=0.05,
    outage_backoff_s=0.05,
)
PAGE = 4096  # tmpfs allocates whole pages


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A server of this module's own: its maxmemory is changed while tests run."""
    with EmbeddedRedis(tmp_path_factory.mktemp("full-redis")) as server:
        yield server


@dataclass
class Backends:
    settings: Settings
    http: httpx.AsyncClient
    client_id: str
    client_secret: str
    stores: RedisStores  # the worker's
    analysis: ScriptedAnalysis
    gate: asyncio.Event  # the analysis waits for it

    @property
    def redis(self) -> Redis:
        return self.stores.redis

    def headers(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def token(self) -> str:
        login = await self.http.post(
            "/request-access-token", json={"client_id": self.client_id, "client_secret": self.client_secret}
        )
        assert login.status_code == 200, login.text
        return str(login.json()["result"]["data"]["token"])

    async def post_search(
        self, token: str, enroll_face: bool = True, client_reference: str = ""
    ) -> httpx.Response:
        fields = {"type": "face_search", "enroll_face": "1" if enroll_face else "0"}
        if client_reference:
            fields["client_reference"] = client_reference
        return await self.http.post(
            "/face-search",
            headers=self.headers(token),
            data=fields,
            files={"file": ("a.png", solid_png(RED), "image/png")},
        )

    async def create(self, token: str, enroll_face: bool = True, client_reference: str = "") -> str:
        response = await self.post_search(token, enroll_face, client_reference)
        assert response.status_code == 200, response.text
        return str(response.json()["result"]["data"]["reference_id"])

    async def states(self, references: list[str]) -> list[TransactionState]:
        found = [await self.stores.transactions.get(reference) for reference in references]
        return [tx.state for tx in found if tx is not None]

    async def final(self, references: list[str]) -> list[Transaction]:
        async def all_final() -> bool:
            states = await self.states(references)
            return len(states) == len(references) and all(state.is_final for state in states)

        await eventually(all_final, "every accepted transaction final")
        found = [await self.stores.transactions.get(reference) for reference in references]
        return [tx for tx in found if tx is not None]


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(1200):  # a hang guard of about a minute, not a speed bound
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


@contextlib.asynccontextmanager
async def backends(
    redis_url: str, milvus_uri: str, blob_dir: Path, results_dir: Path
) -> AsyncIterator[Backends]:
    """The ingress app and a running worker over one Redis key prefix, milvus-lite and blob_dir."""
    settings = Settings(
        data_dir=blob_dir.parent,
        blob_dir=blob_dir,
        results_dir=results_dir,
        redis=RedisSettings(url=redis_url, key_prefix=f"f{uuid.uuid4().hex[:6]}:"),
        milvus=MilvusSettings(uri=None, token=""),
        auth=AuthSettings(secret_key="full-backends-secret-0123456789abcdefghijklmnopqrstuvwxyz"),
        http=HttpSettings(public_base_url=None),
    )
    stores = redis_stores(settings)
    info, secret = await stores.clients.create(TENANT_NAME)
    gallery = MilvusGalleryStore(
        milvus_uri,
        f"full_{uuid.uuid4().hex[:8]}",
        model_version=TEST_POLICY.model_version,
        dimension=EMBEDDING_SIZE,
    )
    gate = asyncio.Event()
    analysis = ScriptedAnalysis({RED: [face(embedding(1))]})
    analysis.gate = gate
    processor = TransactionProcessor(
        stores.transactions,
        stores.records,
        gallery,
        LocalBlobStore(blob_dir),
        analysis,
        TEST_POLICY,
        stores.clients,
    )
    worker = QueueWorker("full-backends", stores.transactions, processor, POLICY)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    app = create_app(build_api_services(settings))
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as http:
            yield Backends(settings, http, info.client_id, secret, stores, analysis, gate)
    finally:
        gate.set()
        stop.set()
        await asyncio.wait_for(running, 30)
        await gallery.close()
        await stores.redis.aclose()


# -- Redis at its maxmemory ----------------------------------------------------------------------------------


def test_the_embedded_redis_never_evicts_keys_and_an_evicting_one_is_reported(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Evicting a key at maxmemory would drop accepted transactions; the server must refuse writes instead.
    The embedded server runs noeviction; a Redis set to evict (a managed default) is logged as an error by
    the check each worker replica runs when it starts."""

    async def scenario() -> None:
        redis = connect_redis(redis_server.url)
        try:
            assert (await redis.info("memory"))["maxmemory_policy"] == "noeviction"
            with caplog.at_level(logging.ERROR, logger="serve_app"):
                assert await check_eviction_policy(redis) == "noeviction"
                assert not caplog.records
                await redis.config_set("maxmemory-policy", "volatile-lru")
                try:
                    assert await check_eviction_policy(redis) == "volatile-lru"
                finally:
                    await redis.config_set("maxmemory-policy", "noeviction")
            (record,) = caplog.records
            assert "maxmemory-policy volatile-lru" in record.getMessage()
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_full_redis_refuses_creates_with_503_keeps_what_it_accepted_and_recovers(
    redis_server: EmbeddedRedis, milvus_lite: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)

    def requeues() -> int:
        return sum("requeued" in record.getMessage() for record in caplog.records)

    async def scenario() -> None:
        async with backends(redis_server.url, milvus_lite, tmp_path / "blobs", tmp_path / "results") as b:
            token = await b.token()
            # Three accepted, held by the worker mid-analysis: one that writes only its result, two that
            # enrol first (one under a client_reference, whose lock is a write too).
            accepted = [
                await b.create(token, enroll_face=False),
                await b.create(token),
                await b.create(token, client_reference="customer-full-redis"),
            ]

            async def held() -> bool:
                return b.analysis.started == 3

            await eventually(held, "the worker holding all three")
            raw = connect_redis(redis_server.url)
            await raw.config_set("maxmemory", 1)
            try:
                refused = await b.post_search(token)
                assert refused.status_code == 503, refused.text
                assert refused.headers["Retry-After"] == "5"
                body = refused.json()
                assert body == {
                    "status": False,
                    "message": BackendUnavailable.public_message,
                    "errors": {},
                }
                assert_no_backend_text(refused.text)
                # Every request counts against its client's limits in Redis: reads and logins wait too.
                for answer in (
                    await b.http.post(
                        "/result", headers=b.headers(token), json={"reference_id": accepted[0]}
                    ),
                    await b.http.post(
                        "/request-access-token",
                        json={"client_id": b.client_id, "client_secret": b.client_secret},
                    ),
                ):
                    assert answer.status_code == 503 and answer.headers["Retry-After"] == "5", answer.text
                # The create itself is one script: refused whole, nothing of it is written.
                before = await raw.dbsize()
                with pytest.raises(BackendUnavailable) as error:
                    await b.stores.transactions.create_and_enqueue(make_tx(tenant_id=b.client_id))
                assert type(error.value) is BackendUnavailable  # an outage, never a failed attempt
                assert await raw.dbsize() == before

                b.gate.set()  # each attempt now fails at its first write: the lock, the record, the result

                async def attempted_often() -> bool:
                    return requeues() >= 3 * (POLICY.max_deliveries + 2)

                await eventually(attempted_often, "attempts meeting the full Redis")
                # Attempted far more often than max_deliveries, and not one of them given up.
                assert set(await b.states(accepted)) <= {TransactionState.QUEUED, TransactionState.PROCESSING}
                assert (await b.stores.transactions.count_by_state())["failed"] == 0
            finally:
                await raw.config_set("maxmemory", 0)
                freed_at = time.monotonic()
                await raw.aclose()
            # No traceback per request while it lasted: a full Redis is an outage, not a bug.
            errors = [
                r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("serve_app")
            ]
            assert not errors, caplog.text

            # Memory freed: the same app and worker go on, no restart.
            late = await b.create(token)
            done = await b.final([*accepted, late])
            assert [tx.state for tx in done] == [TransactionState.COMPLETED] * 4, [tx.error for tx in done]
            enrolled = {face_id for _tenant, face_id in await b.stores.records.all_face_ids(b.client_id)}
            assert enrolled == {enrolled_face_id(reference) for reference in [*accepted[1:], late]}
            print(
                f"full Redis: {len(accepted)} accepted before, {requeues()} attempts requeued while full,"
                f" 0 failed; all {len(done)} completed {time.monotonic() - freed_at:.2f} s after maxmemory"
                " was raised"
            )
            for reference in [*accepted, late]:
                read = await b.http.post(
                    "/result", headers=b.headers(token), json={"reference_id": reference}
                )
                assert read.status_code == 200, read.text

    asyncio.run(scenario())


# -- a full disk -------------------------------------------------------------------------------------------


def _cannot_mount(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the full-disk test must run in CI: {why}")
    pytest.skip(why)


@contextlib.contextmanager
def small_filesystem(mount_point: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of size_bytes mounted at mount_point (under the test's tmp dir), always unmounted after."""
    mount_point.mkdir()
    if os.geteuid() != 0:
        _cannot_mount("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        _cannot_mount(f"mount -t tmpfs failed: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def fill(directory: Path, free_pages: int = 0) -> Path:
    """Writes a file until the file system refuses (ENOSPC), then gives back free_pages pages (one: room
    for a blob's small content-type file, none for its data)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = 64 * 1024
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                chunk //= 2
        if free_pages:
            pages = -(-os.fstat(fd).st_size // PAGE)
            os.ftruncate(fd, (pages - free_pages) * PAGE)
    finally:
        os.close(fd)
    return filler


def files_under(directory: Path) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()}


def test_a_full_disk_answers_507_the_client_retries_and_every_accepted_transaction_ends_final(
    milvus_lite: str, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async def scenario(disk: Path) -> None:
        blobs, results = disk / "blobs", disk / "results"
        async with backends(redis_server.url, milvus_lite, blobs, results) as b:
            token = await b.token()
            accepted = [
                await b.create(token, enroll_face=False),  # its upload goes once it is final
                await b.create(token, client_reference="customer-full-disk"),  # its upload is its proof
            ]
            filler = fill(disk, free_pages=1)
            stored = files_under(blobs)

            for _ in range(2):
                refused = await b.post_search(token)
                assert refused.status_code == 507, refused.text
                assert refused.headers["Retry-After"] == "30"
                assert refused.json() == {
                    "status": False,
                    "message": StorageFull.public_message,
                    "errors": {},
                }
                assert_no_backend_text(refused.text)
            # A refused upload leaves nothing: no temporary file, no content-type file without its data.
            assert files_under(blobs) == stored

            # The worker finishes what was accepted on the full disk: it writes no blob, it only deletes.
            b.gate.set()
            done = await b.final(accepted)
            assert [tx.state for tx in done] == [TransactionState.COMPLETED] * 2, [tx.error for tx in done]
            proof = await LocalBlobStore(blobs).get(done[1].image_key)
            assert proof is not None and proof[0] == solid_png(RED)

            # The result archive cannot write either: it keeps the Redis copies and says why.
            archive = result_archive(b.settings)
            with pytest.raises(StorageFull):
                await archive_finished(b.stores.transactions, archive, 0.0)
            assert await b.states(accepted) == [TransactionState.COMPLETED] * 2

            # Still full. The Python client retries the 507; the operator frees space while it waits.
            slept: list[float] = []
            freed_at: list[float] = []

            async def operator_frees_space(delay: float) -> None:
                slept.append(delay)
                filler.unlink(missing_ok=True)
                freed_at.append(time.monotonic())

            async with AsyncFaceSearchClient(
                client_id=b.client_id, client_secret=b.client_secret, http=b.http, sleep=operator_frees_space
            ) as client:
                late = await client.submit_face_search(solid_png(RED), enroll_face=False)
            assert slept == [30.0]

            final = await b.final([*accepted, late])
            assert [tx.state for tx in final] == [TransactionState.COMPLETED] * 3
            print(
                f"full disk: {len(accepted)} accepted before, 3 uploads answered 507 (the last the client's"
                f" first try), all 3 accepted completed, the client's retry final"
                f" {time.monotonic() - freed_at[0]:.2f} s after space was freed"
            )
            report = await archive_finished(b.stores.transactions, archive, 0.0)
            assert report.archived == report.dropped == 3
            for reference in [*accepted, late]:
                read = await b.http.post(
                    "/result", headers=b.headers(token), json={"reference_id": reference}
                )
                assert read.status_code == 200, read.text

    with small_filesystem(tmp_path / "disk", 512 * 1024) as disk:
        asyncio.run(scenario(disk))


def test_a_redis_whose_own_disk_is_full_refuses_writes_as_an_outage_and_resumes_once_freed(
    tmp_path: Path,
) -> None:
    """Redis appends every write to its AOF (fsynced each second). On a full disk it answers writes from
    memory until its next flush fails, then refuses them (MISCONF) until a flush succeeds again: a 503 and a
    requeue, never a failed transaction, and nothing it answered is lost."""

    async def scenario(server: EmbeddedRedis, disk: Path) -> None:
        redis = connect_redis(server.url)
        store = RedisTransactionStore(redis, prefix="d:")
        try:
            accepted = [await store.create_and_enqueue(make_tx())]
            filler = fill(disk)
            refused: BackendUnavailable | None = None
            for _ in range(600):  # a hang guard of about half a minute, not a speed bound
                try:
                    accepted.append(await store.create_and_enqueue(make_tx()))
                except BackendUnavailable as error:
                    refused = error
                    break
                await asyncio.sleep(0.05)
            assert type(refused) is BackendUnavailable and "MISCONF" in refused.message, refused

            answered_before = len(accepted)
            filler.unlink()
            freed_at = time.monotonic()

            async def writes_again() -> bool:
                try:
                    accepted.append(await store.create_and_enqueue(make_tx()))
                except BackendUnavailable:
                    return False
                return True

            await eventually(writes_again, "Redis writing again once space is free")
            print(
                f"full Redis disk: {answered_before} creates answered, then MISCONF; writing again"
                f" {time.monotonic() - freed_at:.2f} s after space was freed"
            )
            for reference_id in accepted:
                assert await store.get(reference_id) is not None

            async def all_in_the_aof() -> bool:  # appendonly.aof (Redis 6), appendonlydir/ (Redis 7)
                files = [path for path in server.data_dir.rglob("appendonly*") if path.is_file()]
                written = "".join(path.read_text(errors="replace") for path in files)
                return all(reference_id in written for reference_id in accepted)

            await eventually(all_in_the_aof, "every answered create in the append-only file")
        finally:
            await redis.aclose()

    with (
        small_filesystem(tmp_path / "disk", 2 * 1024 * 1024) as disk,
        EmbeddedRedis(disk / "redis") as server,
    ):
        asyncio.run(scenario(server, disk))

"""The stores against real servers: redis-server and milvus-lite started by serve_app.launch.embedded in a
temporary directory, bound to 127.0.0.1. Nothing here is mocked.

Each test runs its coroutine with asyncio.run and makes its own clients, and uses its own key prefix or
collection, so tests do not share state through the session-scoped servers.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from pymilvus import DataType, MilvusClient

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.domain.identifiers import new_client_id
from serve_app.domain.outcomes import FaceMatch, FaceSearchOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.launch.embedded import EmbeddedMilvus, EmbeddedRedis, EmbeddedServices, free_port
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import (
    Admission,
    BlobStore,
    ClientStore,
    FaceRecordStore,
    GalleryStore,
    LockPolicy,
    RateLimiter,
    RequestAdmission,
    TransactionStore,
    WorkQueue,
    request_counter_key,
)
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis, text, text_map
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.integration.conftest import GalleryBackend
from tests.integration.gallery_support import gallery_faces, gallery_rows

T = TypeVar("T")
PEPPER = "integration-test-pepper-0123456789"


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path_factory.mktemp("stores"))
    services.start()
    try:
        yield services
    finally:
        services.stop()


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(scenario())


# Hang guard, not a speed bound: every call below has its own deadline of a few seconds (socket timeouts,
# Milvus' timeout_s, a lock's blocking timeout); pymilvus' own retries, the failure these guard against,
# take minutes. Speed is measured by bench/stores.py.
HANG_GUARD_S = 60.0


async def settle(awaitable: Awaitable[T]) -> T:
    """The awaitable's outcome; TimeoutError if it hangs past HANG_GUARD_S."""
    return await asyncio.wait_for(awaitable, HANG_GUARD_S)


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


NO_FACE = FaceSearchOutcome(is_face_found=False)


def make_tx(tenant: str = "tenant-a", **changes: Any) -> Transaction:
    now = time.time()
    fields: dict[str, Any] = {
        "reference_id": new_reference_id(),
        "tenant_id": tenant,
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


def unit(rng: np.random.Generator, dimension: int) -> np.ndarray:
    values = rng.standard_normal(dimension).astype(np.float32)
    return values / np.linalg.norm(values)


def vector(rng: np.random.Generator) -> np.ndarray:
    """A unit vector, as face models store (the gallery searches by inner product)."""
    raw = rng.standard_normal(128)
    return (raw / np.linalg.norm(raw)).astype(np.float32)


def test_stores_implement_the_interfaces(tmp_path: Path) -> None:
    """Mostly a static check: mypy rejects an assignment whose implementation drifted from its Protocol."""
    redis = connect_redis("redis://127.0.0.1:1/0")  # no I/O happens
    transactions: TransactionStore = RedisTransactionStore(redis)
    queue: WorkQueue = RedisTransactionStore(redis)
    records: FaceRecordStore = RedisFaceRecordStore(redis)
    clients: ClientStore = RedisClientStore(redis, pepper=PEPPER)
    limiter: RateLimiter = RedisRateLimiter(redis)
    admission: RequestAdmission = RedisRequestAdmission(redis)
    gallery_store: GalleryStore = MilvusGalleryStore("http://127.0.0.1:1", model_version="v1", dimension=128)
    blobs: BlobStore = LocalBlobStore(tmp_path)
    assert all((transactions, queue, records, clients, limiter, admission, gallery_store, blobs))
    with pytest.raises(ValueError):
        RedisClientStore(redis, pepper="short")
    asyncio.run(redis.aclose())


# -- embedded servers ------------------------------------------------------------------------------------


def test_servers_listen_on_loopback_only(servers: EmbeddedServices) -> None:
    if shutil.which("ss") is None:
        pytest.skip("ss is not installed")
    assert servers.redis is not None and servers.milvus is not None
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    for pid in (servers.redis.pid, servers.milvus.pid):
        sockets = [line.split()[3] for line in listing.splitlines() if f"pid={pid}," in line]
        assert sockets, f"pid {pid} listens nowhere?\n{listing}"
        for address in sockets:
            assert address.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")), address


def test_second_start_reuses_the_live_servers(servers: EmbeddedServices) -> None:
    second = EmbeddedServices(servers.data_dir)
    second.start()
    assert second.redis is not None and second.milvus is not None
    assert (second.redis_url, second.milvus_uri) == (servers.redis_url, servers.milvus_uri)
    assert not second.redis.owned and not second.milvus.owned
    second.stop()  # not its servers: they keep running
    assert servers.redis is not None and servers.redis.is_running()
    assert servers.milvus is not None and servers.milvus.is_running()


def test_missing_redis_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serve_app.launch.embedded import EmbeddedServerError

    monkeypatch.setattr(EmbeddedRedis, "binary", staticmethod(lambda: "/nonexistent/redis-server"))
    with pytest.raises(EmbeddedServerError, match="cannot run"):
        EmbeddedRedis(tmp_path).start()


# -- transactions and queue ------------------------------------------------------------------------------


def test_transaction_lifecycle(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        store = RedisTransactionStore(redis, prefix=prefix())
        try:
            tx = make_tx()
            await store.create_and_enqueue(tx)
            assert await store.get(tx.reference_id) == tx
            assert await store.get("unknown") is None
            assert await store.depth() == 1
            assert (await store.count_by_state())["queued"] == 1

            entries = await store.claim("worker-1", count=10, block_ms=100)
            assert [(e.reference_id, e.deliveries) for e in entries] == [(tx.reference_id, 1)]
            assert await store.claim("worker-1", count=10, block_ms=0) == []

            processing = await store.mark_processing(tx.reference_id)
            assert processing is not None
            assert (processing.state, processing.attempts) == (TransactionState.PROCESSING, 1)
            again = await store.mark_processing(tx.reference_id)  # a redelivery bumps attempts
            assert again is not None and again.attempts == 2

            first = FaceSearchOutcome(
                is_face_found=True, matches=(FaceMatch("f1", 0.97, 'ref "quoted"'),), enrolled=True
            )
            assert await store.complete(tx.reference_id, first) is True
            await store.fail(tx.reference_id, "too late")  # never overwrites a final state
            assert await store.complete(tx.reference_id, FaceSearchOutcome(is_face_found=False)) is False
            assert await store.mark_processing(tx.reference_id) is None
            final = await store.get(tx.reference_id)
            assert final is not None
            assert final.state is TransactionState.COMPLETED
            # A match is stored without its client_reference (joined from the face record when read).
            assert final.result == FaceSearchOutcome(
                is_face_found=True, matches=(FaceMatch("f1", 0.97, ""),), enrolled=True
            )
            assert final.error is None and final.attempts == 2
            assert final.created_at == tx.created_at and final.client_reference == tx.client_reference

            failed = make_tx(client_reference=None, enroll_face=False)
            await store.create_and_enqueue(failed)
            await store.fail(failed.reference_id, "no face")
            assert await store.complete(failed.reference_id, first) is False
            got = await store.get(failed.reference_id)
            assert got is not None and (got.state, got.error, got.result) == (
                TransactionState.FAILED,
                "no face",
                None,
            )
            assert got.client_reference is None

            assert await store.count_by_state() == {"queued": 0, "processing": 0, "completed": 1, "failed": 1}
            await store.ack([entries[0].entry_id])
            assert await store.depth() == 1  # the failed one was never claimed nor acknowledged
            assert await store.mark_processing("unknown") is None
            assert await store.complete("unknown", NO_FACE) is False  # ignored, no error
        finally:
            await redis.aclose()

    run(scenario)


def test_stale_entries_are_reclaimed_after_consumer_death(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        store = RedisTransactionStore(redis, prefix=prefix())
        try:
            txs = [make_tx() for _ in range(3)]
            for tx in txs:
                await store.create_and_enqueue(tx)
            claimed_by_a = await store.claim("consumer-a", count=10, block_ms=100)
            assert len(claimed_by_a) == 3  # ... and consumer A dies without acknowledging

            assert await store.reclaim_stale("consumer-b", min_idle_ms=300, count=10) == []  # not idle yet
            await asyncio.sleep(0.35)
            reclaimed = await store.reclaim_stale("consumer-b", min_idle_ms=300, count=10)
            assert {e.reference_id for e in reclaimed} == {tx.reference_id for tx in txs}
            assert {e.deliveries for e in reclaimed} == {2}

            # Not acknowledged again: each reclaim counts one more delivery, so poison can be failed.
            await asyncio.sleep(0.35)
            again = await store.reclaim_stale("consumer-c", min_idle_ms=300, count=2)
            assert len(again) == 2 and {e.deliveries for e in again} == {3}

            await store.ack([e.entry_id for e in reclaimed])
            assert await store.depth() == 0
            await asyncio.sleep(0.35)
            assert await store.reclaim_stale("consumer-b", min_idle_ms=300, count=10) == []
            assert await store.claim("consumer-b", count=10, block_ms=50) == []
        finally:
            await redis.aclose()

    run(scenario)


def test_claim_blocks_until_an_entry_arrives(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url), socket_timeout_s=1.5)  # block longer than a read
        store = RedisTransactionStore(redis, prefix=prefix())
        try:
            started = time.monotonic()
            assert await settle(store.claim("w", count=1, block_ms=1200)) == []
            assert time.monotonic() - started > 1.1  # it did wait (longer than one blocking read)
            tx = make_tx()
            waiting = asyncio.create_task(store.claim("w", count=1, block_ms=3000))
            await asyncio.sleep(0.1)
            await store.create_and_enqueue(tx)
            entries = await asyncio.wait_for(waiting, 5)
            assert [e.reference_id for e in entries] == [tx.reference_id]
        finally:
            await redis.aclose()

    run(scenario)


def test_wait_final_wakes_on_completion_and_times_out(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        waiter_redis = connect_redis(str(servers.redis_url))
        worker_redis = connect_redis(str(servers.redis_url))  # as in production: another connection
        p = prefix()
        waiters, worker = (
            RedisTransactionStore(waiter_redis, prefix=p),
            RedisTransactionStore(worker_redis, prefix=p),
        )
        try:
            # The wake-up latency is measured by bench/stores.py; here: a blocked waiter wakes up with the
            # final state long before its own timeout, every time.
            for _ in range(10):
                tx = make_tx()
                await waiters.create_and_enqueue(tx)
                waiting = asyncio.create_task(waiters.wait_final(tx.reference_id, 3600.0))
                await asyncio.sleep(0.01)  # let it block
                await worker.complete(tx.reference_id, NO_FACE)
                final = await settle(waiting)
                assert final is not None and final.state is TransactionState.COMPLETED

            # Already final: immediate. Two waiters on one transaction: both wake.
            tx = make_tx()
            await waiters.create_and_enqueue(tx)
            first = asyncio.create_task(waiters.wait_final(tx.reference_id, 5.0))
            second = asyncio.create_task(waiters.wait_final(tx.reference_id, 5.0))
            await asyncio.sleep(0.05)
            await worker.fail(tx.reference_id, "boom")
            done = await asyncio.wait_for(asyncio.gather(first, second), 2)
            assert [t.state if t else None for t in done] == [TransactionState.FAILED] * 2
            # Already final: answered at once, not after its (hour-long) timeout.
            again = await settle(waiters.wait_final(tx.reference_id, 3600.0))
            assert again is not None and again.state is TransactionState.FAILED
            # A caller that read it pending just before it finished (seen_pending skips the read): the
            # completion signal left behind answers it at once, however often it is consumed.
            for _ in range(3):
                seen = await settle(waiters.wait_final(tx.reference_id, 3600.0, seen_pending=True))
                assert seen is not None and seen.state is TransactionState.FAILED

            # seen_pending, completed while blocked: wakes up with the final state.
            pending = make_tx()
            await waiters.create_and_enqueue(pending)
            waiting = asyncio.create_task(waiters.wait_final(pending.reference_id, 3600.0, seen_pending=True))
            await asyncio.sleep(0.01)
            await worker.complete(pending.reference_id, NO_FACE)
            woken = await settle(waiting)
            assert woken is not None and woken.state is TransactionState.COMPLETED

            # Not final in time: the latest state after the timeout, longer than one blocking chunk.
            slow = make_tx()
            await waiters.create_and_enqueue(slow)
            await worker.mark_processing(slow.reference_id)
            started = time.monotonic()
            latest = await settle(waiters.wait_final(slow.reference_id, 0.5))
            assert latest is not None and latest.state is TransactionState.PROCESSING
            assert time.monotonic() - started > 0.45  # it waited its timeout out
            assert await waiters.wait_final("unknown", 1.0) is None
        finally:
            await waiter_redis.aclose()
            await worker_redis.aclose()

    run(scenario)


def test_finished_transactions_expire_when_configured(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        p = prefix()
        store = RedisTransactionStore(redis, prefix=p, finished_ttl_s=60)
        try:
            tx = make_tx()
            await store.create_and_enqueue(tx)
            assert await redis.ttl(f"{p}txn:{tx.reference_id}") == -1
            await store.complete(tx.reference_id, NO_FACE)
            assert 0 < await redis.ttl(f"{p}txn:{tx.reference_id}") <= 60
        finally:
            await redis.aclose()

    run(scenario)


def test_redis_restart_keeps_data_and_outage_is_backend_unavailable(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:

        async def scenario() -> None:
            redis = connect_redis(server.url, socket_timeout_s=1.0, connect_timeout_s=1.0)
            store = RedisTransactionStore(redis)
            try:
                tx = make_tx()
                await store.create_and_enqueue(tx)
                await asyncio.to_thread(server.stop)

                with pytest.raises(BackendUnavailable, match="Redis is unavailable"):
                    await settle(store.get(tx.reference_id))

                await asyncio.to_thread(server.start)  # same data dir, same port
                assert await store.get(tx.reference_id) == tx  # the old client reconnects by itself
                entries = await store.claim("w", count=5, block_ms=100)
                assert [e.reference_id for e in entries] == [tx.reference_id]
                assert await store.count_by_state() == {
                    "queued": 1,
                    "processing": 0,
                    "completed": 0,
                    "failed": 0,
                }
            finally:
                await redis.aclose()

        run(scenario)
    finally:
        server.stop()


def test_redis_down_fails_fast_in_every_store() -> None:
    async def scenario() -> None:
        redis = connect_redis(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=1, connect_timeout_s=1)
        tx_store = RedisTransactionStore(redis)
        records = RedisFaceRecordStore(redis)
        clients = RedisClientStore(redis, pepper=PEPPER)
        limiter = RedisRateLimiter(redis)
        admission = RedisRequestAdmission(redis)
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: admission.admit(new_client_id(), 10, 60),
            lambda: tx_store.create_and_enqueue(make_tx()),
            lambda: tx_store.get(new_reference_id()),
            lambda: tx_store.mark_processing("x"),
            lambda: tx_store.complete("x", NO_FACE),
            lambda: tx_store.wait_final(new_reference_id(), 1),
            lambda: tx_store.claim("w", 1, 100),
            lambda: tx_store.reclaim_stale("w", 10, 1),
            lambda: tx_store.ack(["1-0"]),
            lambda: tx_store.depth(),
            lambda: records.get("t", "f"),
            lambda: records.all_face_ids(),
            lambda: clients.create("x"),
            lambda: clients.find_by_secret("s"),
            lambda: limiter.hit("k", 1, 1),
        ]
        try:
            for call in calls:
                with pytest.raises(BackendUnavailable, match="Redis is unavailable"):
                    await settle(call())
            with pytest.raises(BackendUnavailable):
                async with records.reference_lock("t", "r", _lock(1.0)):
                    pass
        finally:
            await redis.aclose()

    run(scenario)


# -- face records ----------------------------------------------------------------------------------------


def face_record(tenant: str, reference: str | None, created_at: float) -> FaceRecord:
    return FaceRecord(
        face_id=uuid.uuid4().hex,
        tenant_id=tenant,
        client_reference=reference,
        proof_key=f"proofs/{uuid.uuid4().hex}",
        model_version="dlib-resnet-v1",
        created_at=created_at,
        reference_id=new_reference_id(),
    )


def test_face_records(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        store = RedisFaceRecordStore(redis, prefix=prefix())
        try:
            reference = 'emp:42 "Ann" \\ O\'Neil'
            old = face_record("tenant-a", reference, 1000.0)
            new = face_record("tenant-a", reference, 2000.0)
            other = face_record("tenant-a", None, 1500.0)
            foreign = face_record("tenant-b", reference, 3000.0)
            for record in (old, new, other, foreign):
                await store.put(record)

            assert await store.get("tenant-a", old.face_id) == old
            assert await store.get("tenant-b", old.face_id) is None  # tenant-scoped
            assert await store.get_many("tenant-a", [old.face_id, foreign.face_id, "nope"]) == {
                old.face_id: old
            }
            assert await store.latest_for_reference("tenant-a", reference) == new
            assert await store.latest_for_reference("tenant-b", reference) == foreign
            assert await store.latest_for_reference("tenant-a", "unknown") is None

            assert await store.all_face_ids("tenant-a") == {
                ("tenant-a", r.face_id) for r in (old, new, other)
            }
            everything = await store.all_face_ids()
            assert {("tenant-b", foreign.face_id), ("tenant-a", old.face_id)} <= everything

            await store.delete("tenant-a", new.face_id)
            assert await store.latest_for_reference("tenant-a", reference) == old

            # Re-put under another reference: the old reference no longer finds it.
            moved = FaceRecord(**{**old.__dict__, "client_reference": "other", "created_at": 5000.0})
            await store.put(moved)
            assert await store.latest_for_reference("tenant-a", reference) is None
            assert await store.latest_for_reference("tenant-a", "other") == moved
            await store.put(old)
            await store.delete("tenant-a", new.face_id)  # idempotent
            assert await store.all_face_ids("tenant-a") == {("tenant-a", r.face_id) for r in (old, other)}
            assert await store.count("tenant-a") == 2  # the gallery size behind the default minimum score
            assert await store.count("tenant-b") == 1
            assert await store.count("tenant-none") == 0
        finally:
            await redis.aclose()

    run(scenario)


def _lock(wait_s: float) -> LockPolicy:
    return LockPolicy(wait_s=wait_s, ttl_s=10.0, max_hold_s=60.0)


def test_reference_lock_serialises_and_times_out(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        store = RedisFaceRecordStore(redis, prefix=prefix())
        events: list[str] = []

        async def holder(name: str, hold_s: float) -> None:
            async with store.reference_lock("tenant-a", "ref-1", _lock(2.0)):
                events.append(f"{name} in")
                await asyncio.sleep(hold_s)
                events.append(f"{name} out")

        try:
            await asyncio.gather(holder("a", 0.2), holder("b", 0.0))
            assert events in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])

            # Another reference is independent.
            async with store.reference_lock("tenant-a", "ref-1", _lock(2.0)):
                async with store.reference_lock("tenant-a", "ref-2", _lock(0.5)):
                    pass

                async def take_held_lock() -> None:
                    async with store.reference_lock("tenant-a", "ref-1", _lock(0.3)):
                        pass

                with pytest.raises(BackendUnavailable, match="lock"):
                    await settle(take_held_lock())
        finally:
            await redis.aclose()

    run(scenario)


# -- clients and rate limits -----------------------------------------------------------------------------


def test_client_store_never_stores_the_secret(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        p = prefix()
        store = RedisClientStore(redis, pepper=PEPPER, prefix=p)
        try:
            info, secret = await store.create("Acme kiosk")
            assert info.client_id.startswith("cl_") and len(secret) >= 43 and not info.revoked
            other, other_secret = await store.create("Other")

            assert await store.verify(info.client_id, secret) == info
            assert await store.verify(info.client_id, other_secret) is None
            assert await store.verify("cl_unknown", secret) is None
            assert await store.find_by_secret(secret) == info
            assert await store.find_by_secret(secret + "x") is None
            assert await store.get(info.client_id) == info
            assert [c.client_id for c in await store.list()] == [info.client_id, other.client_id]

            # No key name or value under our prefix contains either plaintext secret.
            dumped: list[str] = []
            async for key in redis.scan_iter(match=f"{p}*"):
                dumped.append(text(key))
                kind = text(await redis.type(key))
                if kind == "string":
                    dumped.append(text(await redis.get(key) or ""))
                elif kind == "hash":
                    dumped.extend(f"{k}={v}" for k, v in text_map(await redis.hgetall(key)).items())
                elif kind == "zset":
                    dumped.extend(text(member) for member in await redis.zrange(key, 0, -1))
                else:
                    raise AssertionError(f"unexpected {kind} at {key}")
            assert dumped and not any(secret in item or other_secret in item for item in dumped)

            assert await store.revoke(info.client_id) is True
            assert await store.revoke("cl_unknown") is False
            assert await store.verify(info.client_id, secret) is None
            assert await store.find_by_secret(secret) is None
            revoked = await store.get(info.client_id)
            assert revoked is not None and revoked.revoked
            assert await store.find_by_secret(other_secret) == other

            # A different pepper (another deployment's key) recognises nothing.
            assert (
                await RedisClientStore(redis, pepper=PEPPER + "!", prefix=p).find_by_secret(other_secret)
                is None
            )
        finally:
            await redis.aclose()

    run(scenario)


def test_rate_limiter(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        limiter = RedisRateLimiter(redis, prefix=prefix())
        try:
            assert [await limiter.hit("k", 3, 1) for _ in range(3)] == [0, 0, 0]
            assert await limiter.hit("k", 3, 1) == 1
            assert await limiter.hit("other", 3, 1) == 0
            await limiter.reset("k")
            assert await limiter.hit("k", 1, 1) == 0
            assert await limiter.hit("k", 1, 1) == 1
            await asyncio.sleep(1.1)  # the window ends
            assert await limiter.hit("k", 1, 1) == 0
            assert 1 <= await limiter.hit("long", 0, 60) <= 60
        finally:
            await redis.aclose()

    run(scenario)


def test_request_admission_checks_the_client_and_counts_in_one_step(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        p = prefix()
        clients = RedisClientStore(redis, pepper=PEPPER, prefix=p)
        limiter = RedisRateLimiter(redis, prefix=p)
        admission = RedisRequestAdmission(redis, prefix=p)
        try:
            active, _ = await clients.create("admitted")
            assert [await admission.admit(active.client_id, 2, 60) for _ in range(2)] == [Admission(True)] * 2
            over = await admission.admit(active.client_id, 2, 60)
            assert over.active and 1 <= over.retry_after_s <= 60
            # The same counter the limiter keeps for the Client-Secret path: a fourth event is over 3.
            assert await limiter.hit(request_counter_key(active.client_id), 3, 60) >= 1

            revoked, _ = await clients.create("revoked")
            assert await clients.revoke(revoked.client_id)
            for unknown in (revoked.client_id, new_client_id(), "not-a-client-id"):
                assert await admission.admit(unknown, 2, 60) == Admission(active=False)
            # Nothing was counted for them: a hit under their key is the first of its window.
            assert await limiter.hit(request_counter_key(revoked.client_id), 1, 60) == 0
        finally:
            await redis.aclose()

    run(scenario)


# -- gallery ---------------------------------------------------------------------------------------------


def gallery(backend: GalleryBackend, **options: Any) -> MilvusGalleryStore:
    settings: dict[str, Any] = {
        "collection": f"faces_{uuid.uuid4().hex[:8]}",
        "model_version": "v1",
        "dimension": 128,
        **options,
    }
    return MilvusGalleryStore(backend.uri, **settings)


def test_gallery_add_search_isolation_delete(gallery_backend: GalleryBackend) -> None:
    async def scenario() -> None:
        store = gallery(gallery_backend)
        rng = np.random.default_rng(7)
        try:
            a = [GalleryEntry(uuid.uuid4().hex, "tenant-a", "v1", vector(rng), time.time()) for _ in range(3)]
            b = [GalleryEntry(uuid.uuid4().hex, "tenant-b", "v1", a[0].embedding.copy(), time.time())]
            await store.add(a[:1])
            assert store.partitioned is gallery_backend.server  # milvus-lite has no partitions
            # Visible to the very next search (Strong consistency).
            first = await store.search("tenant-a", a[0].embedding, 5, 0.6)
            assert [m.face_id for m in first] == [a[0].face_id]
            assert first[0].similarity == pytest.approx(1.0, abs=1e-3)

            await store.add(a[1:] + b)
            await store.add(a[1:2])  # re-adding replaces, no duplicate
            assert len(await gallery_rows(gallery_backend.uri, store.collection)) == 4

            probe = a[1].embedding + rng.standard_normal(128).astype(np.float32) * 0.01
            probe /= np.linalg.norm(probe)
            matches = await store.search("tenant-a", probe, 10, -1.0)
            assert matches[0].face_id == a[1].face_id
            assert {m.face_id for m in matches} == {e.face_id for e in a}  # never tenant-b's twin
            expected = float(probe @ a[1].embedding)
            assert matches[0].similarity == pytest.approx(expected, abs=1e-4)  # inner product = cosine
            assert [m.similarity for m in matches] == sorted((m.similarity for m in matches), reverse=True)
            assert await store.search("tenant-a", probe, 10, expected - 1e-3) == matches[:1]
            assert await store.search("tenant-c", probe, 10, -1.0) == []
            assert await store.search("tenant-a", probe, 0, -1.0) == []

            faces = await gallery_faces(gallery_backend.uri, store.collection, "tenant-b")
            assert faces == {("tenant-b", b[0].face_id)}
            faces = await gallery_faces(gallery_backend.uri, store.collection)
            assert faces == {(e.tenant_id, e.face_id) for e in a + b}

            await store.delete("tenant-b", [a[0].face_id])  # another tenant's id: nothing happens
            assert len(await gallery_rows(gallery_backend.uri, store.collection)) == 4
            await store.delete("tenant-a", [a[0].face_id, a[2].face_id])
            assert [m.face_id for m in await store.search("tenant-a", probe, 10, -1.0)] == [a[1].face_id]
            assert len(await gallery_rows(gallery_backend.uri, store.collection)) == 2

            with pytest.raises(ValueError):
                await store.search('tenant-a" or tenant_id != "x', probe, 10, -1.0)
            with pytest.raises(ValueError):
                await store.add([GalleryEntry("f", "tenant-a", "v1", np.zeros(64, np.float32), 0.0)])
        finally:
            await store.close()

    run(scenario)


def test_gallery_versions_never_meet(gallery_backend: GalleryBackend) -> None:
    """Vectors of one face model version are never compared with another's: each version has its own
    collection (and dimension), and a vector of another version cannot be added. Searches filter on the
    tenant alone, so the collections alone keep versions apart: a version of the same dimension holding
    the very same vector for the same tenant is not found either."""

    async def scenario() -> None:
        base = f"faces_{uuid.uuid4().hex[:8]}"
        old = gallery(gallery_backend, collection=base, model_version="v1", dimension=128)
        new = gallery(gallery_backend, collection=base, model_version="v2", dimension=256)
        same = gallery(gallery_backend, collection=base, model_version="v1.1", dimension=128)
        rng = np.random.default_rng(3)
        try:
            shared = vector(rng)
            await old.add([GalleryEntry("face-old", "tenant-a", "v1", shared, time.time())])
            twin = np.concatenate([shared, shared]) / np.sqrt(2.0)
            await new.add([GalleryEntry("face-new", "tenant-a", "v2", twin.astype(np.float32), time.time())])
            assert [m.face_id for m in await new.search("tenant-a", twin, 10, -1.0)] == ["face-new"]
            assert [m.face_id for m in await old.search("tenant-a", shared, 10, -1.0)] == ["face-old"]
            with pytest.raises(ValueError, match="cannot join"):
                await new.add([GalleryEntry("face-x", "tenant-a", "v1", twin.astype(np.float32), 0.0)])
            with pytest.raises(ValueError):
                await new.search("tenant-a", shared, 10, -1.0)  # a 128-d probe against the 256-d gallery
            await same.add([GalleryEntry("face-same", "tenant-a", "v1.1", shared, time.time())])
            assert [m.face_id for m in await same.search("tenant-a", shared, 10, -1.0)] == ["face-same"]
            assert [m.face_id for m in await old.search("tenant-a", shared, 10, -1.0)] == ["face-old"]
        finally:
            await old.close()
            await new.close()
            await same.close()

    run(scenario)


def test_versions_whose_names_share_a_collection_are_refused(gallery_backend: GalleryBackend) -> None:
    """Collection names write '.' and '-' as '_', so versions "v.1", "v_1" and "v-1" map to one collection.
    Searches filter on the tenant alone and rely on a collection holding one version: the collection
    records the version that created it, and a store of another version refuses to open it, so it never
    searches (nor adds to) the first version's vectors. Before, the second store opened the collection."""

    async def scenario() -> None:
        base = f"faces_{uuid.uuid4().hex[:8]}"
        held = re.escape("holds face model version 'v.1', not")
        first = gallery(gallery_backend, collection=base, model_version="v.1", dimension=16)
        rng = np.random.default_rng(17)
        probe = unit(rng, 16)
        try:
            await first.add([GalleryEntry("face-first", "tenant-a", "v.1", probe, 0.0)])
            for version in ("v_1", "v-1"):
                other = gallery(gallery_backend, collection=base, model_version=version, dimension=16)
                assert other.collection == first.collection
                try:
                    with pytest.raises(BackendRejected, match=held):
                        await other.page_ids("tenant-a", None, 1)  # opening the collection
                    with pytest.raises(BackendRejected, match=held):
                        await other.search("tenant-a", probe, 10, -1.0)
                    with pytest.raises(BackendRejected, match=held):
                        await other.add([GalleryEntry("face-other", "tenant-a", version, probe, 0.0)])
                finally:
                    await other.close()
            # The first version's store serves its collection as before, and nothing else joined it.
            assert [m.face_id for m in await first.search("tenant-a", probe, 10, -1.0)] == ["face-first"]
            assert len(await gallery_rows(gallery_backend.uri, first.collection)) == 1
        finally:
            await first.close()

    run(scenario)


def test_two_versions_sharing_a_name_opened_at_once_leave_one_owner(gallery_backend: GalleryBackend) -> None:
    """Two stores whose versions map to one collection name open it at the same moment (two replicas of
    different releases starting together): one creates it and serves it, the other is refused, whichever
    wins the race. Neither may end up searching the other's vectors."""

    async def scenario() -> None:
        base = f"faces_{uuid.uuid4().hex[:8]}"
        versions = ("v.1", "v_1")
        stores = [gallery(gallery_backend, collection=base, model_version=v, dimension=16) for v in versions]
        try:
            outcomes = await asyncio.gather(
                *(store.page_ids("tenant-a", None, 1) for store in stores), return_exceptions=True
            )  # each opens the collection
            won = [i for i, outcome in enumerate(outcomes) if not isinstance(outcome, BaseException)]
            refused = [outcome for outcome in outcomes if isinstance(outcome, BackendRejected)]
            assert len(won) == 1 and len(refused) == 1, outcomes
            owner, other = stores[won[0]], stores[1 - won[0]]
            probe = unit(np.random.default_rng(23), 16)
            await owner.add([GalleryEntry("face-owner", "tenant-a", versions[won[0]], probe, 0.0)])
            assert [m.face_id for m in await owner.search("tenant-a", probe, 10, -1.0)] == ["face-owner"]
            with pytest.raises(BackendRejected):
                await other.search("tenant-a", probe, 10, -1.0)
        finally:
            for store in stores:
                await store.close()

    run(scenario)


def test_a_collection_without_a_recorded_version_is_checked_by_its_rows(
    gallery_backend: GalleryBackend,
) -> None:
    """A collection created before collections recorded their model version (the schema of earlier
    releases, no description) is checked by its rows when a store opens it: one holding another version's
    rows is refused, since the store's tenant-only search would return them; one holding only the store's
    own version is served, and its searches return its own rows only."""

    async def scenario() -> None:
        base = f"faces_{uuid.uuid4().hex[:8]}"
        name = f"{base}_v_1"
        client = MilvusClient(uri=gallery_backend.uri, timeout=30)
        schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("face_id", DataType.VARCHAR, max_length=64, is_primary=True)
        schema.add_field("tenant_id", DataType.VARCHAR, max_length=64)
        schema.add_field("model_version", DataType.VARCHAR, max_length=64)
        schema.add_field("created_at", DataType.INT64)
        schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=16)
        index = client.prepare_index_params()
        index.add_index(field_name="embedding", index_type="FLAT", metric_type="IP", params={})
        client.create_collection(name, schema=schema, index_params=index, consistency_level="Strong")
        rng = np.random.default_rng(19)
        probe = unit(rng, 16)
        rows = [
            {"face_id": face_id, "tenant_id": "tenant-a", "model_version": version, "created_at": 0,
             "embedding": probe.tolist()}
            for face_id, version in (("face-own", "v_1"), ("face-other", "v.1"))
        ]  # fmt: skip
        client.insert(name, rows)
        try:
            refused = gallery(gallery_backend, collection=base, model_version="v_1", dimension=16)
            try:
                assert refused.collection == name
                with pytest.raises(
                    BackendRejected, match=re.escape("holds face model version 'v.1', not 'v_1'")
                ):
                    await refused.search("tenant-a", probe, 10, -1.0)
            finally:
                await refused.close()

            client.delete(name, filter='model_version == "v.1"')
            served = gallery(gallery_backend, collection=base, model_version="v_1", dimension=16)
            try:
                assert [m.face_id for m in await served.search("tenant-a", probe, 10, -1.0)] == ["face-own"]
            finally:
                await served.close()
        finally:
            client.drop_collection(name)
            client.close()

    run(scenario)


def test_readding_keeps_every_row_in_its_tenants_partition(gallery_backend: GalleryBackend) -> None:
    """Re-adding faces (a retried enrolment, a reindex) replaces their rows, and every row stays findable
    by its own tenant's filter. Milvus 2.3.5's upsert breaks the second half on a partition-key collection
    (rows land in the wrong partitions), which is why adding is delete-then-insert."""

    async def scenario() -> None:
        store = gallery(gallery_backend, dimension=16)
        rng = np.random.default_rng(21)
        tenants = [f"tenant-{n}" for n in range(8)]
        entries = [
            GalleryEntry(f"face-{n}", tenants[n % len(tenants)], "v1", unit(rng, 16), 0.0) for n in range(120)
        ]
        try:
            await store.add(entries)
            again = [GalleryEntry(e.face_id, e.tenant_id, "v1", unit(rng, 16), 1.0) for e in entries]
            await store.add(again)
            assert len(await gallery_rows(gallery_backend.uri, store.collection)) == len(entries)
            for tenant in tenants:
                mine = {e.face_id for e in again if e.tenant_id == tenant}
                faces = await gallery_faces(gallery_backend.uri, store.collection, tenant)
                assert faces == {(tenant, face_id) for face_id in mine}
            for entry in again[:24]:  # each re-added vector is found by its tenant's search, at cosine 1
                matches = await store.search(entry.tenant_id, entry.embedding, 1, -1.0)
                assert [m.face_id for m in matches] == [entry.face_id]
                assert matches[0].similarity == pytest.approx(1.0, abs=1e-4)
        finally:
            await store.close()

    run(scenario)


def test_milvus_restart_keeps_vectors_and_outage_is_backend_unavailable(tmp_path: Path) -> None:
    server = EmbeddedMilvus(tmp_path / "milvus")
    server.start()
    try:

        async def scenario() -> None:
            store = MilvusGalleryStore(server.uri, timeout_s=2.0, model_version="v1", dimension=128)
            entry = GalleryEntry("face-1", "tenant-a", "v1", vector(np.random.default_rng(1)), time.time())
            try:
                await store.add([entry])
                await asyncio.to_thread(server.stop)
                with pytest.raises(BackendUnavailable, match="Milvus is unavailable"):
                    await settle(store.search("tenant-a", entry.embedding, 1, 1.0))

                await asyncio.to_thread(server.start)  # same data dir, same port
                # The same store recovers at once; the vector inserted before the restart is there.
                matches = await store.search("tenant-a", entry.embedding, 1, 1.0)
                assert [m.face_id for m in matches] == ["face-1"]
            finally:
                await store.close()

        run(scenario)
    finally:
        server.stop()


def test_milvus_unreachable_fails_fast() -> None:
    async def scenario() -> None:
        store = MilvusGalleryStore(
            f"http://127.0.0.1:{free_port()}", timeout_s=2.0, model_version="v1", dimension=128
        )
        for call in (
            lambda: store.search("tenant-a", np.zeros(128, np.float32), 5, 1.0),
            lambda: store.page_ids("tenant-a", None, 5),
            lambda: store.present("tenant-a", ["face-1"]),
        ):
            with pytest.raises(BackendUnavailable, match="Milvus is unavailable"):
                await settle(call())

    run(scenario)


# -- blobs -----------------------------------------------------------------------------------------------


def test_local_blob_store(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = LocalBlobStore(tmp_path / "blobs")
        await store.put("uploads/tenant-a/abc_123", b"\xff\xd8jpeg", "image/jpeg")
        assert await store.get("uploads/tenant-a/abc_123") == (b"\xff\xd8jpeg", "image/jpeg")
        await store.put("uploads/tenant-a/abc_123", b"png", "image/png")  # replaced atomically
        assert await store.get("uploads/tenant-a/abc_123") == (b"png", "image/png")
        assert await store.get("uploads/missing") is None
        with pytest.raises(ValueError):
            await store.put("uploads/x", b"x", "text/plain\r\nX-Injected: 1")
        await store.delete("uploads/tenant-a/abc_123")
        await store.delete("uploads/tenant-a/abc_123")  # idempotent
        assert await store.get("uploads/tenant-a/abc_123") is None

        bad_keys = ("../etc/passwd", "a/../../b", "/etc/passwd", "a//b", "a/", "", "a\\b", "a/./b", "x\x00")
        for bad in (*bad_keys, "é", "a" * 600):
            with pytest.raises(ValueError):
                await store.put(bad, b"x", "text/plain")
            with pytest.raises(ValueError):
                await store.get(bad)
        leftovers = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
        assert leftovers == []  # nothing written, no temp files left
        assert not (tmp_path / "etc").exists()

    run(scenario)


def test_client_search_settings_are_stored_and_cleared(servers: EmbeddedServices) -> None:
    async def scenario() -> None:
        redis = connect_redis(str(servers.redis_url))
        store = RedisClientStore(redis, pepper=PEPPER, prefix=prefix())
        try:
            info, secret = await store.create("tenant")
            assert (info.min_score, info.max_matches) == (None, None)
            updated = await store.update_search_settings(info.client_id, min_score=0.62, max_matches=3)
            assert updated is not None and (updated.min_score, updated.max_matches) == (0.62, 3)
            assert await store.verify(info.client_id, secret) == updated  # the secret is untouched
            [listed] = await store.list()
            assert (listed.min_score, listed.max_matches) == (0.62, 3)
            cleared = await store.update_search_settings(info.client_id, min_score=None, max_matches=3)
            assert cleared is not None and (cleared.min_score, cleared.max_matches) == (None, 3)
            assert await store.update_search_settings("cl_unknown", 0.5, None) is None
            assert await store.get("cl_unknown") is None  # no record was created for it
        finally:
            await redis.aclose()

    run(scenario)

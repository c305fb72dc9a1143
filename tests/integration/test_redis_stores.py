"""What the Redis stores owe to Redis itself, beyond the promises tests/contracts checks on them and on the
fakes alike: blocking reads cut into pieces shorter than the socket timeout, completion signals between
connections, finished transactions that expire, data kept across a restart, an outage reported as
BackendUnavailable, secrets kept only as keyed hashes, reference indexes that may hold stale entries.

A redis-server of serve_app.launch.embedded on 127.0.0.1; each test has its own clients and key prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import AuditAction, AuditEntry
from serve_app.domain.identifiers import new_client_id
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.domain.transactions import TransactionState, new_reference_id
from serve_app.launch.embedded import EmbeddedRedis, free_port
from serve_app.stores.interfaces import LockPolicy
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis, text, text_map
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.contracts.conftest import PEPPER, make_tx

NO_FACE = FaceSearchOutcome(is_face_found=False)
# Hang guard, not a speed bound: every call has its own deadline of seconds (socket timeouts, a lock's
# wait); redis-py's own retries, the failure this guards against, take far longer.
HANG_GUARD_S = 60.0
# A socket timeout of 1.5 s makes the stores block for at most 0.5 s per read (RedisTransactionStore).
SHORT_SOCKET_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis-stores"))
    with server:
        yield server.url


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def guarded() -> None:
        await asyncio.wait_for(scenario(), HANG_GUARD_S)

    asyncio.run(guarded())


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


# -- transactions and queue ------------------------------------------------------------------------------


def test_claim_waits_through_several_blocking_reads(redis_url: str) -> None:
    """A wait longer than one blocking read is made of several: it lasts its block_ms, and an entry that
    arrives meanwhile is handed out."""

    async def scenario() -> None:
        redis = connect_redis(redis_url, socket_timeout_s=SHORT_SOCKET_TIMEOUT_S)
        store = RedisTransactionStore(redis, prefix=prefix())
        try:
            started = time.monotonic()
            assert await store.claim("w", count=1, block_ms=1200) == []
            assert time.monotonic() - started > 1.1  # it did wait (longer than one blocking read)
            tx = make_tx()
            waiting = asyncio.create_task(store.claim("w", count=1, block_ms=3000))
            await asyncio.sleep(0.7)  # past the first blocking read
            await store.create_and_enqueue(tx)
            assert [e.reference_id for e in await waiting] == [tx.reference_id]
        finally:
            await redis.aclose()

    run(scenario)


def test_wait_final_wakes_on_a_completion_made_through_another_connection(redis_url: str) -> None:
    """As in production, the waiter (the API) and the finisher (a worker) are different clients; the waiter
    blocks in pieces of 0.5 s, and a completion in any piece wakes it."""

    async def scenario() -> None:
        waiter_redis = connect_redis(redis_url, socket_timeout_s=SHORT_SOCKET_TIMEOUT_S)
        worker_redis = connect_redis(redis_url)
        p = prefix()
        waiters, worker = (
            RedisTransactionStore(waiter_redis, prefix=p),
            RedisTransactionStore(worker_redis, prefix=p),
        )
        try:
            # A blocked waiter wakes with the final state long before its own timeout, every time.
            for pause in (0.01,) * 9 + (0.7,):  # the last one completes after the first blocking read
                tx = make_tx()
                await waiters.create_and_enqueue(tx)
                waiting = asyncio.create_task(waiters.wait_final(tx.reference_id, 3600.0))
                await asyncio.sleep(pause)  # let it block
                await worker.complete(tx.reference_id, NO_FACE)
                final = await waiting
                assert final is not None and final.state is TransactionState.COMPLETED

            # Not final in time: the latest state after the timeout, several blocking reads later.
            slow = make_tx()
            await waiters.create_and_enqueue(slow)
            await worker.mark_processing(slow.reference_id)
            started = time.monotonic()
            latest = await waiters.wait_final(slow.reference_id, 1.2)
            assert latest is not None and latest.state is TransactionState.PROCESSING
            assert time.monotonic() - started > 1.15  # it waited its timeout out
        finally:
            await waiter_redis.aclose()
            await worker_redis.aclose()

    run(scenario)


def test_finished_transactions_expire_when_configured(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
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


# -- restarts and outages --------------------------------------------------------------------------------


def test_redis_restart_keeps_data_and_outage_is_backend_unavailable(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")

    async def scenario() -> None:
        redis = connect_redis(server.url, socket_timeout_s=1.0, connect_timeout_s=1.0)
        store = RedisTransactionStore(redis)
        try:
            tx = make_tx()
            await store.create_and_enqueue(tx)
            await asyncio.to_thread(server.stop)
            with pytest.raises(BackendUnavailable, match="Redis is unavailable"):
                await store.get(tx.reference_id)

            await asyncio.to_thread(server.start)  # same data dir, same port
            assert await store.get(tx.reference_id) == tx  # the old client reconnects by itself
            entries = await store.claim("w", count=5, block_ms=100)
            assert [e.reference_id for e in entries] == [tx.reference_id]
            counts = await store.count_by_state()
            assert counts == {"queued": 1, "processing": 0, "completed": 0, "failed": 0}
        finally:
            await redis.aclose()

    with server:
        run(scenario)


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
                    await call()
            with pytest.raises(BackendUnavailable):
                async with records.reference_lock(
                    "t", "r", LockPolicy(wait_s=1.0, ttl_s=10.0, max_hold_s=60.0)
                ):
                    pass
        finally:
            await redis.aclose()

    run(scenario)


# -- face records and clients ----------------------------------------------------------------------------


def test_a_reference_index_entry_left_behind_by_a_re_put_is_skipped(redis_url: str) -> None:
    """A face's client_reference never changes (FaceRecordStore.put), so put does not rewrite the reference
    indexes; should a record be put again under another reference, the old reference's index keeps a stale
    entry, which latest_for_reference skips for the reference's real newest face."""

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        store = RedisFaceRecordStore(redis, prefix=prefix())
        older = FaceRecord(
            face_id=f"f{new_reference_id()}",
            tenant_id="tenant-a",
            client_reference="ref-a",
            proof_key="proofs/tenant-a/older",
            model_version="v1",
            created_at=1000.0,
            reference_id=new_reference_id(),
        )
        newer = dataclasses.replace(older, face_id=f"f{new_reference_id()}", created_at=2000.0)
        try:
            for record in (older, newer):
                await store.put(record)
            moved = dataclasses.replace(newer, client_reference="ref-b")
            await store.put(moved)
            assert await store.latest_for_reference("tenant-a", "ref-a") == older
            assert await store.latest_for_reference("tenant-a", "ref-b") == moved
        finally:
            await redis.aclose()

    run(scenario)


def test_client_secrets_are_kept_only_as_hashes_keyed_by_the_pepper(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        p = prefix()
        store = RedisClientStore(redis, pepper=PEPPER, prefix=p)
        try:
            with pytest.raises(ValueError):
                RedisClientStore(redis, pepper="short")
            _, secret = await store.create("Acme kiosk")
            other, other_secret = await store.create("Other")

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

            # A different pepper (another deployment's key) recognises nothing.
            assert await store.find_by_secret(other_secret) == other
            elsewhere = RedisClientStore(redis, pepper=PEPPER + "!", prefix=p)
            assert await elsewhere.find_by_secret(other_secret) is None
            assert await elsewhere.verify(other.client_id, other_secret) is None
        finally:
            await redis.aclose()

    run(scenario)


# -- audit trail ----------------------------------------------------------------------------------------


def test_audit_entries_past_the_retention_are_dropped_and_a_quiet_trail_expires(redis_url: str) -> None:
    """Every deletion request adds an entry: with a retention, an append drops the tenant's entries that
    aged out, and the stream itself lapses once its newest entry is that old."""

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        try:
            audit = RedisAuditLog(redis, prefix=prefix(), retention_s=1)
            entry = AuditEntry(time.time(), "cl_x", AuditAction.DELETE_FACE, 1, "hmac-sha256:0:ab")
            await audit.append("tenant-a", entry)
            await audit.append("tenant-a", entry)
            assert len((await audit.page("tenant-a", None, 10))[0]) == 2
            key = audit._key("tenant-a")
            assert 0 < await redis.ttl(key) <= 1
            await asyncio.sleep(1.1)
            await audit.append("tenant-a", entry)
            assert len((await audit.page("tenant-a", None, 10))[0]) == 1
            await asyncio.sleep(1.1)
            assert await redis.exists(key) == 0

            kept = RedisAuditLog(redis, prefix=prefix())  # no retention: entries stay, the key has no ttl
            await kept.append("tenant-b", entry)
            assert await redis.ttl(kept._key("tenant-b")) == -1
        finally:
            await redis.aclose()

    run(scenario)

"""The gallery management methods of the Redis stores (records' listing indexes, the audit stream)
against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import AuditAction, AuditEntry
from serve_app.domain.transactions import new_reference_id
from serve_app.launch.embedded import EmbeddedServices
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_tenant_clock import RedisTenantClock


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    services = EmbeddedServices(tmp_path_factory.mktemp("gallery-stores"))
    services.start()
    try:
        yield str(services.redis_url)
    finally:
        services.stop()


def record(tenant: str, reference: str | None, created_at: float) -> FaceRecord:
    reference_id = new_reference_id()
    return FaceRecord(
        face_id=f"f{reference_id}",
        tenant_id=tenant,
        client_reference=reference,
        proof_key=f"proofs/{reference_id}",
        model_version="v-test",
        created_at=created_at,
        reference_id=reference_id,
    )


def test_listing_reference_index_and_counts(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        prefix = f"t{uuid.uuid4().hex[:8]}:"
        store = RedisFaceRecordStore(redis, prefix=prefix)
        try:
            # Faces enrolled before the indexes existed: only the record and the tenant set.
            legacy = record("tenant-a", "ref-legacy", 500.0)
            await redis.set(
                f"{prefix}face:tenant-a:{legacy.face_id}", __import__("json").dumps(legacy.__dict__)
            )
            await redis.sadd(f"{prefix}faces:tenant-a", legacy.face_id)
            faces = [record("tenant-a", f"ref-{n % 3}", 1000.0 + n) for n in range(7)]
            faces.append(record("tenant-a", None, 2000.0))
            for face in faces:
                await store.put(face)
            await store.put(record("tenant-b", "ref-0", 9000.0))
            everything = sorted([legacy, *faces], key=lambda r: r.face_id)

            seen: list[FaceRecord] = []
            after = None
            while True:
                page, after = await store.page("tenant-a", after, 3)
                seen += page
                if after is None:
                    break
            assert seen == everything

            ref0 = await store.records_for_reference("tenant-a", "ref-0")
            assert [r.face_id for r in ref0] == sorted(
                r.face_id for r in faces if r.client_reference == "ref-0"
            )
            counts = await store.counts("tenant-a")
            assert (counts.faces, counts.client_references) == (9, 4)
            assert (counts.oldest_enrolment, counts.newest_enrolment) == (500.0, 2000.0)

            # The last face of a reference takes the reference out of the distinct count.
            for face in await store.records_for_reference("tenant-a", "ref-1"):
                await store.delete("tenant-a", face.face_id)
            await store.delete("tenant-a", legacy.face_id)
            counts = await store.counts("tenant-a")
            assert (counts.faces, counts.client_references) == (6, 2)
            assert counts.oldest_enrolment == 1000.0
            page, after = await store.page("tenant-a", None, 50)
            assert after is None and len(page) == 6
            empty = await store.counts("tenant-none")
            assert (empty.faces, empty.client_references, empty.oldest_enrolment) == (0, 0, None)
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_audit_stream_pages_newest_first(redis_url: str) -> None:
    async def scenario() -> None:
        redis = connect_redis(redis_url)
        audit = RedisAuditLog(redis, prefix=f"t{uuid.uuid4().hex[:8]}:")
        try:
            for n in range(5):
                entry = AuditEntry(1000.0 + n, "cl_x", AuditAction.ERASE_REFERENCE, n, f"hash-{n}")
                await audit.append("tenant-a", entry)
            await audit.append("tenant-b", AuditEntry(1.0, "cl_y", AuditAction.DELETE_FACE, 1, "other"))
            first, cursor = await audit.page("tenant-a", None, 2)
            assert [e.faces for e in first] == [4, 3]
            assert cursor is not None
            second, cursor = await audit.page("tenant-a", cursor, 2)
            third, cursor = await audit.page("tenant-a", cursor, 2)
            assert [e.faces for e in second + third] == [2, 1, 0]
            assert cursor is None
            assert third[0] == AuditEntry(1000.0, "cl_x", AuditAction.ERASE_REFERENCE, 0, "hash-0")
            with pytest.raises(ValueError):
                await audit.page("tenant-a", "not-an-id", 2)
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_tenant_write_clock_only_moves_forward(redis_url: str) -> None:
    """The clock keeps each tenant's greatest timestamp, compared exactly at Milvus' 64-bit magnitudes
    (past the 2^53 a Lua number holds), whatever order concurrent writers report them in."""

    async def scenario() -> None:
        redis = connect_redis(redis_url)
        clock = RedisTenantClock(redis, prefix=f"t{uuid.uuid4().hex[:8]}:")
        try:
            assert await clock.read("tenant-a") == 0
            base = 470768440331206661  # a Milvus hybrid timestamp of 2026
            await clock.advance("tenant-a", base + 1)
            await clock.advance("tenant-a", base)  # one above the other only in the last digit
            assert await clock.read("tenant-a") == base + 1
            await clock.advance("tenant-a", 99)  # shorter: smaller
            await clock.advance("tenant-a", 0)  # none given: ignored
            assert await clock.read("tenant-a") == base + 1
            stamps = [base + step for step in range(2, 60)]
            await asyncio.gather(*(clock.advance("tenant-b", stamp) for stamp in reversed(stamps)))
            assert await clock.read("tenant-b") == stamps[-1]
            assert await clock.read("tenant-a") == base + 1  # tenants apart
        finally:
            await redis.aclose()

    asyncio.run(scenario())

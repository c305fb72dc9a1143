"""What the gallery store owes to Milvus itself, beyond the promises tests/contracts/test_gallery.py checks
on it and on the fake alike: on milvus-lite (the default install) and on a Milvus server (tenant_id its
partition key), the tenant filter, the scores and the rows a write leaves; one collection per model
version, which a store of another version never opens; vectors kept across a restart, and an outage
reported as BackendUnavailable.

Each test has its own collection, on the servers of the `gallery_backend` fixture (integration/conftest.py).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pymilvus import DataType, MilvusClient

from serve_app.domain.errors import BackendRejected, BackendUnavailable
from serve_app.domain.faces import GalleryEntry
from serve_app.launch.embedded import EmbeddedMilvus, free_port
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from tests.integration.conftest import GalleryBackend
from tests.integration.gallery_support import gallery_faces, gallery_rows

# Hang guard, not a speed bound: every call has its own deadline of seconds (Milvus' timeout_s); pymilvus'
# own retries, the failure this guards against, take minutes.
HANG_GUARD_S = 60.0


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def guarded() -> None:
        await asyncio.wait_for(scenario(), HANG_GUARD_S)

    asyncio.run(guarded())


def unit(rng: np.random.Generator, dimension: int) -> np.ndarray:
    """A unit vector, as face models give (the gallery searches by inner product)."""
    values = rng.standard_normal(dimension).astype(np.float32)
    return values / np.linalg.norm(values)


def gallery(backend: GalleryBackend, **options: Any) -> MilvusGalleryStore:
    settings: dict[str, Any] = {
        "collection": f"faces_{uuid.uuid4().hex[:8]}",
        "model_version": "v1",
        "dimension": 128,
        **options,
    }
    return MilvusGalleryStore(backend.uri, **settings)


def test_search_filters_by_tenant_and_scores_by_inner_product(gallery_backend: GalleryBackend) -> None:
    """A write is visible to the next search; a tenant never sees another's vectors, exact twins included;
    a match's similarity is the inner product of the unit vectors (their cosine), best first; a delete
    names the tenant, and leaves no row behind."""

    async def scenario() -> None:
        store = gallery(gallery_backend)
        uri, rng = gallery_backend.uri, np.random.default_rng(7)
        try:
            a = [
                GalleryEntry(uuid.uuid4().hex, "tenant-a", "v1", unit(rng, 128), time.time())
                for _ in range(3)
            ]
            b = [GalleryEntry(uuid.uuid4().hex, "tenant-b", "v1", a[0].embedding.copy(), time.time())]
            await store.add(a[:1])
            assert store.partitioned is gallery_backend.server  # milvus-lite has no partitions
            first = await store.search("tenant-a", a[0].embedding, 5, 0.6)  # no tenant clock: Strong
            assert [m.face_id for m in first] == [a[0].face_id]
            assert first[0].similarity == pytest.approx(1.0, abs=1e-3)

            await store.add(a[1:] + b)
            probe = a[1].embedding + rng.standard_normal(128).astype(np.float32) * 0.01
            probe /= np.linalg.norm(probe)
            matches = await store.search("tenant-a", probe, 10, -1.0)
            expected = sorted(((float(probe @ e.embedding), e.face_id) for e in a), reverse=True)
            assert [m.face_id for m in matches] == [face_id for _, face_id in expected]  # not tenant-b's twin
            assert [m.similarity for m in matches] == pytest.approx([s for s, _ in expected], abs=1e-4)
            assert await store.search("tenant-c", probe, 10, -1.0) == []
            assert await gallery_faces(uri, store.collection, "tenant-b") == {("tenant-b", b[0].face_id)}

            await store.delete("tenant-b", [a[0].face_id])  # another tenant's id: nothing happens
            assert len(await gallery_rows(uri, store.collection)) == 4
            await store.delete("tenant-a", [a[0].face_id, a[2].face_id])
            assert [m.face_id for m in await store.search("tenant-a", probe, 10, -1.0)] == [a[1].face_id]
            left = {("tenant-a", a[1].face_id), ("tenant-b", b[0].face_id)}
            assert await gallery_faces(uri, store.collection) == left
            assert len(await gallery_rows(uri, store.collection)) == 2
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
            shared = unit(rng, 128)
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

    async def scenario() -> None:
        store = MilvusGalleryStore(server.uri, timeout_s=2.0, model_version="v1", dimension=128)
        entry = GalleryEntry("face-1", "tenant-a", "v1", unit(np.random.default_rng(1), 128), time.time())
        try:
            await store.add([entry])
            await asyncio.to_thread(server.stop)
            with pytest.raises(BackendUnavailable, match="Milvus is unavailable"):
                await store.search("tenant-a", entry.embedding, 1, 1.0)

            await asyncio.to_thread(server.start)  # same data dir, same port
            # The same store recovers at once; the vector inserted before the restart is there.
            matches = await store.search("tenant-a", entry.embedding, 1, 1.0)
            assert [m.face_id for m in matches] == ["face-1"]
        finally:
            await store.close()

    with server:
        run(scenario)


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
                await call()

    run(scenario)


def test_a_page_may_be_larger_than_one_milvus_query_batch(gallery_backend: GalleryBackend) -> None:
    """Milvus answers at most 16,384 rows per query batch and pymilvus refuses a larger batch size: a
    page of ids asked for beyond that (as a test or an operator's tool may) is read in several batches,
    in face id order, and says where to go on."""
    rows = 16_500

    async def scenario() -> None:
        store = gallery(gallery_backend, dimension=2)
        vector = np.array([1.0, 0.0], dtype=np.float32)
        entries = [GalleryEntry(f"face-{n:05d}", "tenant-big", "v1", vector, 0.0) for n in range(rows)]
        try:
            await store.add(entries)
            everything, after = await store.page_ids("tenant-big", None, 100_000)
            assert (everything, after) == ([entry.face_id for entry in entries], None)
            first, after = await store.page_ids("tenant-big", None, 16_400)
            assert first == everything[:16_400] and after == everything[16_399]
            rest, after = await store.page_ids("tenant-big", after, 16_400)
            assert (rest, after) == (everything[16_400:], None)
        finally:
            await store.close()

    run(scenario)

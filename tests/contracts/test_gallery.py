"""GalleryStore: the fake and the Milvus store (on milvus-lite) keep the same promises."""

from __future__ import annotations

import time

import numpy as np
import pytest

from serve_app.domain.faces import GalleryEntry, GalleryMatch
from serve_app.stores.interfaces import GalleryStore
from tests.contracts.conftest import MODEL_VERSION, Opener, run_with
from tests.unit.fakes import EMBEDDING_SIZE, at_cosine, embedding

# float32 vectors: the similarity Milvus computes and the cosine asked for differ by rounding only.
TOLERANCE = 1e-4


def entry(tenant: str, face_id: str, vector: np.ndarray, model_version: str = MODEL_VERSION) -> GalleryEntry:
    return GalleryEntry(face_id, tenant, model_version, vector, time.time())


def similarities(matches: list[GalleryMatch]) -> list[tuple[str, float]]:
    return [(match.face_id, round(match.similarity, 3)) for match in matches]


async def faces(store: GalleryStore, *tenants: str) -> set[tuple[str, str]]:
    """(tenant, face_id) of the tenants' vectors, through the interface's own scan."""
    found = set()
    for tenant in tenants or ("tenant-a", "tenant-b", "tenant-c"):
        face_ids, cursor = await store.page_ids(tenant, None, 1000)
        assert cursor is None
        found |= {(tenant, face_id) for face_id in face_ids}
    return found


def test_search_finds_the_tenants_faces_best_first_above_the_bar(open_gallery: Opener[GalleryStore]) -> None:
    async def scenario(store: GalleryStore) -> None:
        probe = embedding(1)
        await store.add(
            [
                entry("tenant-a", "f-close", at_cosine(probe, 0.9, seed=1)),
                entry("tenant-a", "f-mid", at_cosine(probe, 0.7, seed=2)),
                entry("tenant-a", "f-far", at_cosine(probe, 0.2, seed=3)),
                entry("tenant-b", "f-other-tenant", probe),
            ]
        )
        matches = await store.search("tenant-a", probe, 10, 0.5)
        assert similarities(matches) == [("f-close", 0.9), ("f-mid", 0.7)]
        assert abs(matches[0].similarity - 0.9) < TOLERANCE
        assert similarities(await store.search("tenant-a", probe, 1, -1.0)) == [("f-close", 0.9)]
        assert len(await store.search("tenant-a", probe, 10, -1.0)) == 3
        assert await store.search("tenant-c", probe, 10, -1.0) == []
        assert await store.search("tenant-a", probe, 0, -1.0) == []
        assert await store.search("tenant-a", probe, -1, -1.0) == []

    run_with(open_gallery, scenario)


def test_adding_a_face_again_replaces_its_vector(open_gallery: Opener[GalleryStore]) -> None:
    async def scenario(store: GalleryStore) -> None:
        first, second = embedding(1), embedding(2)
        await store.add([entry("tenant-a", "f-1", first)])
        await store.add([entry("tenant-a", "f-1", second)])
        assert await faces(store) == {("tenant-a", "f-1")}
        assert similarities(await store.search("tenant-a", second, 10, 0.5)) == [("f-1", 1.0)]
        assert await store.search("tenant-a", first, 10, 0.5) == []
        await store.add([])

    run_with(open_gallery, scenario)


def test_delete_removes_only_the_tenants_named_faces(open_gallery: Opener[GalleryStore]) -> None:
    async def scenario(store: GalleryStore) -> None:
        await store.add(
            [
                entry("tenant-a", "f-1", embedding(1)),
                entry("tenant-a", "f-2", embedding(2)),
                entry("tenant-b", "f-3", embedding(3)),
            ]
        )
        assert await faces(store) == {("tenant-a", "f-1"), ("tenant-a", "f-2"), ("tenant-b", "f-3")}
        assert await faces(store, "tenant-a") == {("tenant-a", "f-1"), ("tenant-a", "f-2")}
        await store.delete("tenant-a", ["f-1", "f-unknown", "f-3"])  # f-3 is tenant-b's: kept
        await store.delete("tenant-a", [])
        assert await faces(store) == {("tenant-a", "f-2"), ("tenant-b", "f-3")}
        assert await faces(store, "tenant-c") == set()
        assert similarities(await store.search("tenant-b", embedding(3), 10, 0.5)) == [("f-3", 1.0)]

    run_with(open_gallery, scenario)


def test_a_face_id_names_one_entry_across_tenants(open_gallery: Opener[GalleryStore]) -> None:
    async def scenario(store: GalleryStore) -> None:
        await store.add([entry("tenant-a", "f-1", embedding(1))])
        await store.add([entry("tenant-b", "f-1", embedding(2))])
        assert await faces(store) == {("tenant-b", "f-1")}
        assert await store.search("tenant-a", embedding(1), 10, -1.0) == []
        assert similarities(await store.search("tenant-b", embedding(2), 10, 0.5)) == [("f-1", 1.0)]

    run_with(open_gallery, scenario)


def test_only_the_stores_model_version_and_dimension_get_in(open_gallery: Opener[GalleryStore]) -> None:
    async def scenario(store: GalleryStore) -> None:
        with pytest.raises(ValueError):
            await store.add([entry("tenant-a", "f-old", embedding(1), model_version="unit-test-v1")])
        with pytest.raises(ValueError):
            await store.add([entry("tenant-a", "f-short", embedding(1)[: EMBEDDING_SIZE // 2])])
        nan = embedding(1)
        nan[0] = np.nan
        with pytest.raises(ValueError):
            await store.add([entry("tenant-a", "f-nan", nan)])
        with pytest.raises(ValueError):
            await store.search("tenant-a", nan, 10, 0.0)
        with pytest.raises(ValueError):
            await store.search("tenant-a", embedding(1)[:10], 10, 0.0)
        assert await faces(store) == set()

    run_with(open_gallery, scenario)


@pytest.mark.parametrize(
    "tenant, face_id",
    [("tenant a", "f-1"), ('tenant-a" or tenant_id != "x', "f-1"), ("tenant-a", 'f"1'), ("tenant-a", "")],
)
def test_ids_outside_the_issued_alphabet_are_refused(
    open_gallery: Opener[GalleryStore], tenant: str, face_id: str
) -> None:
    async def scenario(store: GalleryStore) -> None:
        with pytest.raises(ValueError):
            await store.add([entry(tenant, face_id, embedding(1))])
        with pytest.raises(ValueError):
            await store.delete(tenant, [face_id])
        if tenant != "tenant-a":
            with pytest.raises(ValueError):
                await store.search(tenant, embedding(1), 10, 0.0)
        assert await faces(store) == set()

    run_with(open_gallery, scenario)

"""The fake GalleryStore."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from serve_app.domain.faces import GalleryEntry, GalleryMatch
from serve_app.stores.milvus_gallery import _checked_id as checked_id  # the real store's id rule
from tests.unit.fakes.common import EMBEDDING_SIZE, MODEL_VERSION, Faults


def _checked_vector(embedding: np.ndarray) -> np.ndarray:
    vector = np.asarray(embedding, dtype=np.float32).reshape(-1)
    if vector.shape != (EMBEDDING_SIZE,) or not np.isfinite(vector).all():
        raise ValueError(f"embedding must be {EMBEDDING_SIZE} finite floats")
    return vector


class FakeGalleryStore:
    """Vectors of one model version (model_version), as the Milvus store keeps one collection per version.

    Like Milvus' primary key, a face_id names one entry whatever its tenant: adding it again replaces it.
    Entries are checked as the Milvus store checks them (its own id rule, the dimension, finite values),
    all of them before any is stored."""

    def __init__(self, faults: Faults | None = None, model_version: str = MODEL_VERSION) -> None:
        self._faults = faults or Faults()
        self._model_version = model_version
        self._items: dict[tuple[str, str], GalleryEntry] = {}
        self.searches: list[tuple[str, int, float]] = []  # (tenant_id, limit, min_similarity)

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        await self._faults.check("gallery.add")
        checked = [self._checked_entry(entry) for entry in entries]
        for entry in checked:
            for key in [key for key in self._items if key[1] == entry.face_id]:
                del self._items[key]
            self._items[(entry.tenant_id, entry.face_id)] = entry

    def _checked_entry(self, entry: GalleryEntry) -> GalleryEntry:
        if entry.model_version != self._model_version:
            raise ValueError(
                f"a {entry.model_version!r} vector cannot join the {self._model_version!r} gallery"
            )
        checked_id(entry.face_id, "face_id")
        checked_id(entry.tenant_id, "tenant_id")
        return dataclasses.replace(entry, embedding=_checked_vector(entry.embedding))

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        await self._faults.check("gallery.search")
        self.searches.append((tenant_id, limit, min_similarity))
        if limit <= 0:
            return []
        probe = _checked_vector(embedding).astype(np.float64)
        checked_id(tenant_id, "tenant_id")
        scored = []
        for (tenant, face_id), entry in self._items.items():
            if tenant != tenant_id:
                continue
            similarity = float(entry.embedding.astype(np.float64) @ probe)
            if similarity >= min_similarity:
                scored.append(GalleryMatch(face_id, similarity))
        scored.sort(key=lambda match: (-match.similarity, match.face_id))
        return scored[:limit]

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None:
        await self._faults.check("gallery.delete")
        if not face_ids:
            return
        checked_id(tenant_id, "tenant_id")
        for face_id in face_ids:
            checked_id(face_id, "face_id")
        for face_id in face_ids:
            self._items.pop((tenant_id, face_id), None)

    async def page_ids(
        self, tenant_id: str, after: str | None, limit: int, *, all_versions: bool = False
    ) -> tuple[list[str], str | None]:
        # One model version only: all_versions reads the same vectors.
        await self._faults.check("gallery.page_ids")
        chosen = sorted(f for t, f in self._items if t == tenant_id and (after is None or f > after))[:limit]
        return chosen, (chosen[-1] if len(chosen) == limit else None)

    async def present(
        self, tenant_id: str, face_ids: Sequence[str], *, all_versions: bool = False
    ) -> set[str]:
        await self._faults.check("gallery.present")
        return {face_id for face_id in face_ids if (tenant_id, face_id) in self._items}

    # Test helpers.
    def pairs(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        """(tenant_id, face_id) of every vector (of the tenant's)."""
        return {key for key in self._items if tenant_id is None or key[0] == tenant_id}

    def face_ids(self, tenant_id: str | None = None) -> set[str]:
        return {face_id for tenant, face_id in self._items if tenant_id is None or tenant == tenant_id}

    def entry(self, tenant_id: str, face_id: str) -> GalleryEntry:
        return self._items[(tenant_id, face_id)]

"""The fake GalleryStore."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from serve_app.domain.faces import GalleryEntry, GalleryMatch
from tests.unit.fakes.common import EMBEDDING_SIZE, Faults


class FakeGalleryStore:
    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self._items: dict[tuple[str, str], GalleryEntry] = {}
        self.searches: list[tuple[str, int, float]] = []  # (tenant_id, limit, min_similarity)

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        await self._faults.check("gallery.add")
        for entry in entries:
            embedding = np.asarray(entry.embedding, dtype=np.float32)
            assert embedding.shape == (EMBEDDING_SIZE,), embedding.shape
            self._items[(entry.tenant_id, entry.face_id)] = dataclasses.replace(entry, embedding=embedding)

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        await self._faults.check("gallery.search")
        self.searches.append((tenant_id, limit, min_similarity))
        probe = np.asarray(embedding, dtype=np.float64)
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
        for face_id in face_ids:
            self._items.pop((tenant_id, face_id), None)

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        await self._faults.check("gallery.all_face_ids")
        return {key for key in self._items if tenant_id is None or key[0] == tenant_id}

    async def count(self) -> int:
        await self._faults.check("gallery.count")
        return len(self._items)

    # Test helpers.
    def face_ids(self, tenant_id: str | None = None) -> set[str]:
        return {face_id for tenant, face_id in self._items if tenant_id is None or tenant == tenant_id}

    def entry(self, tenant_id: str, face_id: str) -> GalleryEntry:
        return self._items[(tenant_id, face_id)]

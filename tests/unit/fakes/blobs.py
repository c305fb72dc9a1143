"""The fake BlobStore."""

from __future__ import annotations

import time

from serve_app.stores.blobs import validate_content_type, validate_key
from serve_app.stores.interfaces import BlobPage, SweptPage
from tests.unit.fakes.common import Faults


class FakeBlobStore:
    """Keys and content types are checked by the file store's own rules."""

    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self.items: dict[str, tuple[bytes, str]] = {}
        self.written_at: dict[str, float] = {}  # key -> time.time() of its last write

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        await self._faults.check("blobs.put")
        validate_key(key)
        validate_content_type(content_type)
        self.items[key] = (bytes(data), content_type)
        self.written_at[key] = time.time()

    async def get(self, key: str) -> tuple[bytes, str] | None:
        await self._faults.check("blobs.get")
        validate_key(key)
        return self.items.get(key)

    async def delete(self, key: str) -> None:
        await self._faults.check("blobs.delete")
        validate_key(key)
        self.items.pop(key, None)
        self.written_at.pop(key, None)

    async def sweep_old(self, after: str | None, older_than_s: float, limit: int) -> SweptPage:
        """Keys in order, the cursor being the last key of the page."""
        await self._faults.check("blobs.sweep_old")
        cutoff = time.time() - older_than_s
        keys = sorted(key for key in self.items if after is None or key > after)[:limit]
        doomed = [key for key in keys if self.written_at.get(key, 0.0) < cutoff]
        for key in doomed:
            await self.delete(key)
        return SweptPage(len(doomed), keys[-1] if len(keys) == limit else None)

    async def scan_old(self, after: str | None, older_than_s: float, limit: int) -> BlobPage:
        """Keys in order, the cursor being the last key of the page."""
        await self._faults.check("blobs.scan_old")
        cutoff = time.time() - older_than_s
        keys = sorted(key for key in self.items if after is None or key > after)[:limit]
        old = [key for key in keys if self.written_at.get(key, 0.0) < cutoff]
        return BlobPage(old, 0, keys[-1] if len(keys) == limit else None)

"""What the file blob store (serve_app.stores.blobs.LocalBlobStore) owes to the file system, beyond the
promises tests/contracts/test_blobs_audit.py checks on it and on the fake alike: a replacement leaves no
temporary file behind, and a refused key writes nothing, inside the store's directory or outside it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from serve_app.stores.blobs import LocalBlobStore


def test_writes_leave_no_stray_file_inside_or_outside_the_store(tmp_path: Path) -> None:
    root = tmp_path / "blobs"

    async def scenario() -> None:
        store = LocalBlobStore(root)
        await store.put("uploads/tenant-a/abc_123", b"\xff\xd8jpeg", "image/jpeg")
        await store.put("uploads/tenant-a/abc_123", b"png", "image/png")  # replaced by a rename
        assert await store.get("uploads/tenant-a/abc_123") == (b"png", "image/png")
        await store.delete("uploads/tenant-a/abc_123")
        for key in ("../etc/passwd", "a/../../etc/b", "/etc/passwd", "a\\b", "x\x00"):
            with pytest.raises(ValueError):
                await store.put(key, b"x", "text/plain")
        with pytest.raises(ValueError):
            await store.put("uploads/x", b"x", "text/plain\r\nX-Injected: 1")

    asyncio.run(scenario())
    assert [p for p in root.rglob("*") if p.is_file()] == []  # no temporary file, no refused write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs"]  # nothing written beside the store

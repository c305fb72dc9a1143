"""BlobStore (fake vs the file store) and AuditLog (fake vs Redis streams) keep the same promises."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.domain.gallery import AuditAction, AuditEntry
from serve_app.stores.interfaces import AuditLog, BlobStore
from tests.contracts.conftest import Opener, run_with

# ------------------------------------------------------------------------------------------- blobs


def test_blobs_read_back_with_their_content_type(open_blobs: Opener[BlobStore]) -> None:
    async def scenario(store: BlobStore) -> None:
        await store.put("uploads/abc_1-2", b"\x00\xffimage", "image/png")
        await store.put("proofs/tenant-a/f1", b"", "image/jpeg")
        assert await store.get("uploads/abc_1-2") == (b"\x00\xffimage", "image/png")
        assert await store.get("proofs/tenant-a/f1") == (b"", "image/jpeg")
        await store.put("uploads/abc_1-2", b"replaced", "image/webp")
        assert await store.get("uploads/abc_1-2") == (b"replaced", "image/webp")
        assert await store.get("uploads/never-written") is None
        await store.delete("uploads/abc_1-2")
        await store.delete("uploads/abc_1-2")  # again: nothing happens
        assert await store.get("uploads/abc_1-2") is None
        assert await store.get("proofs/tenant-a/f1") == (b"", "image/jpeg")

    run_with(open_blobs, scenario)


@pytest.mark.parametrize(
    "key",
    [
        *("", "../escape", "a/../../b", "a/./b", "/absolute", "trailing/", "double//slash", "dot.png"),
        *("space here", "back\\slash", "nul\x00", "ünï", "a" * 513),
    ],
)
def test_a_key_outside_the_key_alphabet_is_refused(open_blobs: Opener[BlobStore], key: str) -> None:
    async def scenario(store: BlobStore) -> None:
        with pytest.raises(ValueError):
            await store.put(key, b"data", "image/png")
        with pytest.raises(ValueError):
            await store.get(key)
        with pytest.raises(ValueError):
            await store.delete(key)

    run_with(open_blobs, scenario)


@pytest.mark.parametrize("content_type", ["", "image/png\r\nX-Injected: 1", "ïmage/png", "x" * 256])
def test_a_content_type_outside_printable_ascii_is_refused(
    open_blobs: Opener[BlobStore], content_type: str
) -> None:
    async def scenario(store: BlobStore) -> None:
        with pytest.raises(ValueError):
            await store.put("uploads/a", b"data", content_type)
        assert await store.get("uploads/a") is None

    run_with(open_blobs, scenario)


def test_sweep_old_deletes_old_blobs_a_page_at_a_time(open_blobs: Opener[BlobStore]) -> None:
    async def scenario(store: BlobStore) -> None:
        old = [f"uploads/old-{n}" for n in range(6)] + ["proofs/t/old-6"]
        for key in old:
            await store.put(key, b"data", "image/png")
        page = await store.sweep_old(None, 3600.0, 100)
        assert (page.removed, page.after) == (0, None)  # nothing is an hour old
        await asyncio.sleep(0.05)
        between = time.time()  # old ones before, the new one after: each call's age reaches back to it
        await asyncio.sleep(0.05)
        await store.put("uploads/new", b"data", "image/png")
        removed, after, pages = 0, None, 0
        while True:
            page = await store.sweep_old(after, time.time() - between, 2)
            removed, after, pages = removed + page.removed, page.after, pages + 1
            if after is None:
                break
        assert removed == len(old) and pages > 1  # in pages, each of about `limit`
        assert await store.get("uploads/new") == (b"data", "image/png")
        for key in old:
            assert await store.get(key) is None

    run_with(open_blobs, scenario)


# ------------------------------------------------------------------------------------------- audit


def audit_entry(n: int, actor: str = "cl_000000000000000000000001") -> AuditEntry:
    action = AuditAction.ERASE_REFERENCE if n % 2 else AuditAction.DELETE_FACE
    return AuditEntry(at=1_700_000_000.125 + n, actor=actor, action=action, faces=n, subject=f"ref é {n}")


def test_audit_pages_run_newest_first_and_never_repeat(open_audit: Opener[AuditLog]) -> None:
    async def scenario(log: AuditLog) -> None:
        assert await log.page("tenant-a", None, 10) == ([], None)
        for n in range(5):
            await log.append("tenant-a", audit_entry(n))
        await log.append("tenant-b", audit_entry(99))
        first, cursor = await log.page("tenant-a", None, 2)
        assert first == [audit_entry(4), audit_entry(3)] and cursor is not None
        await log.append("tenant-a", audit_entry(5))  # appended meanwhile: on no later page
        second, cursor = await log.page("tenant-a", cursor, 2)
        assert second == [audit_entry(2), audit_entry(1)] and cursor is not None
        third, cursor = await log.page("tenant-a", cursor, 2)
        assert (third, cursor) == ([audit_entry(0)], None)
        everything, cursor = await log.page("tenant-a", None, 6)
        assert everything == [audit_entry(n) for n in range(5, -1, -1)] and cursor is not None
        assert await log.page("tenant-a", cursor, 6) == ([], None)
        assert await log.page("tenant-b", None, 10) == ([audit_entry(99)], None)

    run_with(open_audit, scenario)


@pytest.mark.parametrize("cursor", ["", "garbage", "123", "-1", "1-2-3", "1-x"])
def test_a_value_not_of_the_cursor_form_is_refused(open_audit: Opener[AuditLog], cursor: str) -> None:
    async def scenario(log: AuditLog) -> None:
        await log.append("tenant-a", audit_entry(1))
        with pytest.raises(ValueError):
            await log.page("tenant-a", cursor, 10)

    run_with(open_audit, scenario)

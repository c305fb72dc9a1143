"""FaceRecordStore: the fake and the Redis store keep the same promises."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from serve_app.domain.errors import LockUnavailable
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import GalleryCounts
from serve_app.domain.transactions import new_reference_id
from serve_app.stores.interfaces import FaceRecordStore, LockPolicy
from tests.contracts.conftest import MODEL_VERSION, Opener, run_with


def record(tenant: str, reference: str | None, created_at: float, face_id: str | None = None) -> FaceRecord:
    reference_id = new_reference_id()
    face_id = face_id or f"f{reference_id}"
    return FaceRecord(
        face_id=face_id,
        tenant_id=tenant,
        client_reference=reference,
        proof_key=f"proofs/{tenant}/{face_id}",
        model_version=MODEL_VERSION,
        created_at=created_at,
        reference_id=reference_id,
    )


def test_records_read_back_per_tenant(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        a1 = record("tenant-a", "ref ünïcode 🙂", 1000.25)
        a2 = dataclasses.replace(record("tenant-a", None, 1001.5), replaces="fsomething")
        b1 = record("tenant-b", "ref ünïcode 🙂", 1002.0)
        for item in (a1, a2, b1):
            await store.put(item)
        assert await store.get("tenant-a", a1.face_id) == a1
        assert await store.get("tenant-a", a2.face_id) == a2
        assert await store.get("tenant-a", b1.face_id) is None  # another tenant's face
        assert await store.get_many("tenant-a", [a2.face_id, "fmissing", b1.face_id, a1.face_id]) == {
            a1.face_id: a1,
            a2.face_id: a2,
        }
        assert await store.get_many("tenant-a", []) == {}
        assert (await store.count("tenant-a"), await store.count("tenant-b")) == (2, 1)
        assert await store.count("tenant-c") == 0
        assert await store.all_face_ids("tenant-a") == {("tenant-a", a1.face_id), ("tenant-a", a2.face_id)}
        assert await store.all_face_ids() == {
            ("tenant-a", a1.face_id),
            ("tenant-a", a2.face_id),
            ("tenant-b", b1.face_id),
        }
        await store.delete("tenant-a", a1.face_id)
        await store.delete("tenant-a", a1.face_id)  # again: nothing happens
        await store.delete("tenant-a", b1.face_id)  # another tenant's face: nothing happens
        assert await store.get("tenant-a", a1.face_id) is None
        assert await store.count("tenant-a") == 1
        assert await store.all_face_ids() == {("tenant-a", a2.face_id), ("tenant-b", b1.face_id)}

    run_with(open_records, scenario)


def test_putting_a_face_again_replaces_its_record(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        first = record("tenant-a", "ref-1", 1000.0)
        await store.put(first)
        reindexed = dataclasses.replace(first, model_version="unit-test-v3")
        await store.put(reindexed)
        assert await store.get("tenant-a", first.face_id) == reindexed
        assert await store.latest_for_reference("tenant-a", "ref-1") == reindexed
        assert await store.records_for_reference("tenant-a", "ref-1") == [reindexed]
        assert await store.count("tenant-a") == 1
        assert await store.counts("tenant-a") == GalleryCounts(1, 1, 1000.0, 1000.0)

    run_with(open_records, scenario)


def test_latest_for_reference_is_the_newest_enrolment(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        reference = 'emp:42 "Ann" \\ O\'Neil'  # quotes, a backslash, a colon: key and script syntax
        old = record("tenant-a", reference, 1000.0)
        new = record("tenant-a", reference, 2000.0)
        other_reference = record("tenant-a", "ref-2", 3000.0)
        other_tenant = record("tenant-b", reference, 4000.0)
        for item in (new, old, other_reference, other_tenant):  # put order is not what counts
            await store.put(item)
        assert await store.latest_for_reference("tenant-a", reference) == new
        assert await store.latest_for_reference("tenant-b", reference) == other_tenant
        await store.delete("tenant-a", new.face_id)
        assert await store.latest_for_reference("tenant-a", reference) == old
        await store.delete("tenant-a", old.face_id)
        assert await store.latest_for_reference("tenant-a", reference) is None
        assert await store.latest_for_reference("tenant-a", "never used") is None

    run_with(open_records, scenario)


def test_latest_for_reference_breaks_a_tie_by_face_id(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        low = record("tenant-a", "ref-1", 1000.0, face_id="f" + "1" * 32)
        high = record("tenant-a", "ref-1", 1000.0, face_id="f" + "e" * 32)
        for item in (high, low):
            await store.put(item)
        assert await store.latest_for_reference("tenant-a", "ref-1") == high

    run_with(open_records, scenario)


def test_page_walks_the_tenant_in_face_id_order(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        faces = [record("tenant-a", f"ref-{n % 2}", 1000.0 + n) for n in range(5)]
        for item in faces:
            await store.put(item)
        await store.put(record("tenant-b", "ref-0", 1.0))
        ordered = sorted(faces, key=lambda item: item.face_id)
        first, cursor = await store.page("tenant-a", None, 2)
        assert (first, cursor) == (ordered[:2], ordered[1].face_id)
        # Faces enrolled or deleted meanwhile never make the walk repeat or skip a face that stays.
        await store.delete("tenant-a", ordered[2].face_id)
        before = record("tenant-a", "ref-0", 5000.0, face_id="f" + "0" * 32)
        after = record("tenant-a", "ref-0", 5000.0, face_id="f" + "f" * 32)
        for item in (before, after):
            await store.put(item)
        second, cursor = await store.page("tenant-a", cursor, 2)
        assert (second, cursor) == (ordered[3:5], ordered[4].face_id)
        third, cursor = await store.page("tenant-a", cursor, 2)
        assert (third, cursor) == ([after], None)
        assert await store.page("tenant-a", after.face_id, 2) == ([], None)
        # A full last page still gives a cursor; the page after it is empty.
        everything, cursor = await store.page("tenant-a", None, 6)
        assert everything == sorted([*ordered[:2], *ordered[3:], before, after], key=lambda r: r.face_id)
        assert cursor == after.face_id
        assert await store.page("tenant-a", cursor, 6) == ([], None)
        assert await store.page("tenant-c", None, 10) == ([], None)

    run_with(open_records, scenario)


def test_records_for_reference_and_counts(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        assert await store.counts("tenant-a") == GalleryCounts(0, 0, None, None)
        ref1 = [record("tenant-a", "ref-1", t) for t in (3000.0, 1000.0)]
        ref2 = record("tenant-a", "ref-2", 500.0)
        anonymous = record("tenant-a", None, 4000.0)
        elsewhere = record("tenant-b", "ref-1", 10.0)
        for item in (*ref1, ref2, anonymous, elsewhere):
            await store.put(item)
        assert await store.records_for_reference("tenant-a", "ref-1") == sorted(
            ref1, key=lambda item: item.face_id
        )
        assert await store.records_for_reference("tenant-a", "nothing") == []
        assert await store.counts("tenant-a") == GalleryCounts(4, 2, 500.0, 4000.0)
        await store.delete("tenant-a", ref2.face_id)
        await store.delete("tenant-a", anonymous.face_id)
        assert await store.counts("tenant-a") == GalleryCounts(2, 1, 1000.0, 3000.0)
        await store.delete("tenant-a", ref1[0].face_id)
        assert await store.counts("tenant-a") == GalleryCounts(1, 1, 1000.0, 1000.0)
        assert await store.counts("tenant-b") == GalleryCounts(1, 1, 10.0, 10.0)

    run_with(open_records, scenario)


def lock(wait_s: float, ttl_s: float = 10.0, max_hold_s: float = 60.0) -> LockPolicy:
    return LockPolicy(wait_s=wait_s, ttl_s=ttl_s, max_hold_s=max_hold_s)


def test_existing_names_the_faces_with_a_record(open_records: Opener[FaceRecordStore]) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        a1, b1 = record("tenant-a", None, 1.0), record("tenant-b", "ref", 2.0)
        for item in (a1, b1):
            await store.put(item)
        asked = [
            ("tenant-a", a1.face_id),
            ("tenant-b", a1.face_id),
            ("tenant-b", b1.face_id),
            ("tenant-a", "fx"),
        ]
        assert await store.existing(asked) == {("tenant-a", a1.face_id), ("tenant-b", b1.face_id)}
        assert await store.existing([]) == set()

    run_with(open_records, scenario)


def test_reference_lock_excludes_and_gives_up_after_its_wait(
    open_records: Opener[FaceRecordStore],
) -> None:
    async def scenario(store: FaceRecordStore) -> None:
        inside: list[str] = []
        overlaps: list[int] = []

        async def hold(name: str) -> None:
            async with store.reference_lock("tenant-a", "ref-1", lock(10.0)):
                inside.append(name)
                overlaps.append(len(inside))
                await asyncio.sleep(0.02)
                inside.remove(name)

        await asyncio.gather(*(hold(f"holder-{n}") for n in range(4)))
        assert overlaps == [1, 1, 1, 1]

        holding, release = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with store.reference_lock("tenant-a", "ref-1", lock(10.0)):
                holding.set()
                await release.wait()

        task = asyncio.create_task(holder())
        await holding.wait()
        # Other references and tenants are not held up.
        async with store.reference_lock("tenant-a", "ref-2", lock(1.0)):
            pass
        async with store.reference_lock("tenant-b", "ref-1", lock(1.0)):
            pass
        with pytest.raises(LockUnavailable):
            async with store.reference_lock("tenant-a", "ref-1", lock(0.2)):
                pass
        release.set()
        await task
        async with store.reference_lock("tenant-a", "ref-1", lock(1.0)):
            pass

    run_with(open_records, scenario)


def test_a_working_holder_keeps_the_lock_past_its_ttl(open_records: Opener[FaceRecordStore]) -> None:
    """The lock is renewed while its holder works: a slow holder is not overtaken after ttl_s."""

    async def scenario(store: FaceRecordStore) -> None:
        taken, release = asyncio.Event(), asyncio.Event()
        face = record("tenant-a", "ref-1", 1.0)

        async def slow_holder() -> None:
            async with store.reference_lock("tenant-a", "ref-1", lock(5.0, ttl_s=0.3)) as held:
                taken.set()
                await release.wait()
                held.check()
                await store.put(face, held)

        task = asyncio.create_task(slow_holder())
        await taken.wait()
        with pytest.raises(LockUnavailable):  # waits three of the lock's ttls: it never lapsed
            async with store.reference_lock("tenant-a", "ref-1", lock(0.9)):
                pass
        release.set()
        await task
        assert await store.get("tenant-a", face.face_id) == face

    run_with(open_records, scenario)


def test_a_holder_past_its_max_hold_loses_the_lock_and_cannot_write(
    open_records: Opener[FaceRecordStore],
) -> None:
    """A holder stuck past max_hold_s stops renewing: the lock lapses ttl_s later, the next holder takes it,
    and from then on every write that names the stuck holder's lock is refused, with nothing written."""

    async def scenario(store: FaceRecordStore) -> None:
        taken, release = asyncio.Event(), asyncio.Event()
        stuck_face = record("tenant-a", "ref-1", 1.0)
        next_face = record("tenant-a", "ref-1", 2.0)
        refused: list[str] = []

        async def stuck_holder() -> None:
            async with store.reference_lock(
                "tenant-a", "ref-1", lock(5.0, ttl_s=0.2, max_hold_s=0.2)
            ) as held:
                taken.set()
                await release.wait()
                with pytest.raises(LockUnavailable):
                    held.check()
                for write in (
                    lambda: store.put(stuck_face, held),
                    lambda: store.delete("tenant-a", next_face.face_id, held),
                    lambda: store.mark_erased("tenant-a", "ref-1", 3.0, held),
                ):
                    with pytest.raises(LockUnavailable):
                        await write()
                    refused.append("refused")

        task = asyncio.create_task(stuck_holder())
        await taken.wait()
        async with store.reference_lock("tenant-a", "ref-1", lock(5.0)) as held:
            await store.put(next_face, held)
            release.set()
            await task
            # The stuck holder's release took nothing from the holder that has the lock now.
            with pytest.raises(LockUnavailable):
                async with store.reference_lock("tenant-a", "ref-1", lock(0.1)):
                    pass
        assert refused == ["refused"] * 3
        assert await store.get("tenant-a", stuck_face.face_id) is None
        assert await store.get("tenant-a", next_face.face_id) == next_face
        assert await store.erased_at("tenant-a", "ref-1") is None

    run_with(open_records, scenario)

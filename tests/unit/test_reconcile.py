"""Reconciliation of face records (Redis) against vectors (Milvus), above the store interfaces.

The same pass against the real stores, interleaved with enrolments, removals and re-indexing:
tests/integration/test_reconcile_concurrency.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from serve_app.domain.faces import FaceRecord, GalleryEntry, GalleryMatch
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.pipelines.reconcile import ReconcilePolicy, Reconciler, ReconcileReport
from serve_app.stores.interfaces import GalleryStore
from tests.unit.fakes import TEST_LOCK, ManualClock, World, embedding

GRACE_S = 600.0
ENROLLED = FaceSearchOutcome(is_face_found=True, enrolled=True)
VERSION = "unit-test-v2"  # World's policy


class FakeReconcileState:
    """ReconcileState in memory; the lease expires on the given clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.lease: tuple[str, float] | None = None  # (holder, expires at)
        self.fields: dict[str, str] = {}
        self.suspects: dict[tuple[str, str], dict[str, float]] = {}
        self.renewals_left: int | None = None  # a number: renewals after it fail (the lease is lost)

    @property
    def cursor(self) -> str | None:
        return self.fields.get("cursor")

    @property
    def last(self) -> float | None:
        return float(self.fields["last-pass"]) if "last-pass" in self.fields else None

    def _holder(self) -> str | None:
        if self.lease is None or self.lease[1] <= self._clock():
            return None
        return self.lease[0]

    async def acquire(self, holder: str, ttl_s: float) -> bool:
        if self._holder() not in (None, holder):
            return False
        self.lease = (holder, self._clock() + ttl_s)
        return True

    async def renew(self, holder: str, ttl_s: float) -> bool:
        if self.renewals_left is not None:
            if self.renewals_left == 0:
                self.lease = None
            self.renewals_left -= 1
        if self._holder() != holder:
            return False
        self.lease = (holder, self._clock() + ttl_s)
        return True

    async def release(self, holder: str) -> None:
        if self._holder() == holder:
            self.lease = None

    async def read(self, field: str) -> str | None:
        return self.fields.get(field)

    async def write(self, holder: str, values: dict[str, str | None]) -> bool:
        if self._holder() != holder:
            return False
        for field, value in values.items():
            if value is None:
                self.fields.pop(field, None)
            else:
                self.fields[field] = value
        return True

    async def add_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str], seen_at: float) -> None:
        noted = self.suspects.setdefault((kind, tenant_id), {})
        for face_id in face_ids:
            noted.setdefault(face_id, seen_at)

    async def due_suspects(
        self, kind: str, tenant_id: str, seen_before: float, offset: int, limit: int
    ) -> list[str]:
        noted = self.suspects.get((kind, tenant_id), {})
        due = sorted((at, face_id) for face_id, at in noted.items() if at <= seen_before)
        return [face_id for _, face_id in due[offset : offset + limit]]

    async def drop_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str]) -> None:
        for face_id in face_ids:
            self.suspects.get((kind, tenant_id), {}).pop(face_id, None)

    async def count_suspects(self, kind: str, tenant_id: str) -> int:
        return len(self.suspects.get((kind, tenant_id), {}))

    async def last_completed(self) -> float | None:
        return self.last


class Setup:
    def __init__(self, grace_s: float = GRACE_S, batch: int = 1000, blob_sweep: bool = False) -> None:
        self.world = World()
        self.clock = ManualClock(start=time.time())
        self.state = FakeReconcileState(self.clock)
        self.policy = ReconcilePolicy(
            grace_s=grace_s,
            batch=batch,
            lease_s=60,
            lock=TEST_LOCK,
            model_version=VERSION,
            orphan_grace_s=3600 if blob_sweep else None,
        )

    def reconciler(self, holder: str = "test", gallery: GalleryStore | None = None) -> Reconciler:
        return Reconciler(
            records=self.world.record_store,
            gallery=gallery if gallery is not None else self.world.gallery,
            transactions=self.world.transactions,
            state=self.state,
            holder=holder,
            policy=self.policy,
            blobs=self.world.blobs,
            clock=self.clock,
        )

    async def run(self, holder: str = "test", gallery: GalleryStore | None = None) -> ReconcileReport:
        report = await self.reconciler(holder, gallery).run_pass()
        assert report is not None and report.completed
        return report

    async def transaction(self, tenant_id: str, client_reference: str | None = None) -> Transaction:
        """A face-search transaction with enrolment, as the ingress leaves it: queued."""
        reference_id = new_reference_id()
        tx = Transaction(
            reference_id=reference_id,
            tenant_id=tenant_id,
            kind=TransactionKind.FACE_SEARCH,
            state=TransactionState.QUEUED,
            created_at=self.clock(),
            updated_at=self.clock(),
            image_key=f"uploads/{tenant_id}/{reference_id}",
            enroll_face=True,
            client_reference=client_reference,
        )
        await self.world.transactions.create_and_enqueue(tx)
        return tx

    def record(self, tx: Transaction, version: str = VERSION) -> FaceRecord:
        return FaceRecord(
            face_id=enrolled_face_id(tx.reference_id),
            tenant_id=tx.tenant_id,
            client_reference=tx.client_reference,
            proof_key=tx.image_key,
            model_version=version,
            created_at=tx.created_at,
            reference_id=tx.reference_id,
        )

    async def record_only(self, tx: Transaction) -> FaceRecord:
        """What an enrolment interrupted between its two writes leaves: record and proof, no vector."""
        record = self.record(tx)
        await self.world.blobs.put(record.proof_key, b"proof", "image/png")
        await self.world.record_store.put(record)
        return record

    async def vector_only(self, tenant_id: str, face_id: str) -> None:
        """What an interrupted removal leaves: a vector whose record is gone."""
        entry = GalleryEntry(face_id, tenant_id, VERSION, embedding(len(face_id)), self.clock())
        await self.world.gallery.add([entry])


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_orphans_on_both_sides_are_repaired_once_seen_twice_a_grace_period_apart() -> None:
    async def scenario() -> None:
        setup = Setup()
        whole = await setup.world.enrol("tenant-a", "whole", embedding(1))
        await setup.vector_only("tenant-a", "orphan-vector")
        # Another tenant's vector without a record there (a face id names one vector across tenants).
        await setup.vector_only("tenant-b", "whole-b")
        gone = setup.record(await setup.transaction("tenant-b"))  # tenant-b had a face once
        await setup.world.record_store.put(gone)
        await setup.world.record_store.delete("tenant-b", gone.face_id)
        given_up = await setup.transaction("tenant-a")
        stale = await setup.record_only(given_up)
        await setup.world.transactions.fail(given_up.reference_id, "gave up")

        first = await setup.run()
        assert (first.vectors_removed, first.records_removed, first.suspects) == (0, 0, 3)
        assert setup.world.gallery.pairs() == {
            ("tenant-a", "whole"),
            ("tenant-a", "orphan-vector"),
            ("tenant-b", "whole-b"),
        }
        setup.clock.advance(GRACE_S - 1)
        assert (await setup.run()).vectors_removed == 0  # first seen less than the grace period ago

        setup.clock.advance(1)
        second = await setup.run()
        assert (second.vectors_removed, second.records_removed, second.suspects) == (2, 1, 0)
        assert setup.world.gallery.pairs() == {("tenant-a", "whole")}
        assert await setup.world.record_store.all_face_ids() == {("tenant-a", "whole")}
        assert stale.proof_key not in setup.world.blobs.items
        assert whole.proof_key in setup.world.blobs.items

    run(scenario)


def test_a_record_whose_transaction_is_not_final_is_never_removed() -> None:
    async def scenario() -> None:
        setup = Setup()
        tx = await setup.transaction("tenant-a", client_reference="alice")
        await setup.world.transactions.mark_processing(tx.reference_id)
        record = await setup.record_only(tx)  # the worker died between its two writes
        for _ in range(3):
            report = await setup.run()
            assert (report.records_removed, report.suspects) == (0, 1)
            setup.clock.advance(GRACE_S * 10)
        assert await setup.world.record_store.get("tenant-a", record.face_id) == record

        # Its retry is given up: the transaction is final, so the record is an orphan now.
        await setup.world.transactions.fail(tx.reference_id, "gave up")
        report = await setup.run()
        assert (report.records_removed, report.suspects) == (1, 0)
        assert await setup.world.record_store.get("tenant-a", record.face_id) is None
        assert record.proof_key not in setup.world.blobs.items
        assert ("tenant-a", "alice") in setup.world.record_store.lock_acquisitions

    run(scenario)


def test_a_vector_whose_transaction_is_in_flight_waits_and_debris_is_deleted_under_the_lock() -> None:
    async def scenario() -> None:
        setup = Setup(grace_s=0)
        tx = await setup.transaction("tenant-a", client_reference="bob")
        await setup.world.transactions.mark_processing(tx.reference_id)
        face_id = enrolled_face_id(tx.reference_id)
        await setup.vector_only("tenant-a", face_id)
        # Another enrolment of the tenant between its two writes (its transaction queued): kept too.
        await setup.world.record_store.put(setup.record(await setup.transaction("tenant-a")))
        report = await setup.run()
        assert (report.vectors_removed, report.suspects) == (0, 2)

        await setup.world.transactions.fail(tx.reference_id, "gave up")
        report = await setup.run()
        assert (report.vectors_removed, report.suspects) == (1, 1)  # the other record is still in flight
        assert face_id not in setup.world.gallery.face_ids("tenant-a")
        assert setup.world.record_store.lock_acquisitions == [("tenant-a", "bob")]

    run(scenario)


class EnrolWhenScanned:
    """A gallery that lets an enrolment complete (record, then vector) just before the pass reads vectors:
    the face enrolled between the old pass' two snapshots, which lost its vector."""

    def __init__(self, setup: Setup, inner: GalleryStore) -> None:
        self._setup = setup
        self._inner = inner
        self.enrolled: list[str] = []

    async def _enrol(self) -> None:
        if not self.enrolled:
            tx = await self._setup.transaction("tenant-a")
            record = self._setup.record(tx)
            await self._setup.world.record_store.put(record)
            await self._inner.add(
                [GalleryEntry(record.face_id, "tenant-a", VERSION, embedding(7), record.created_at)]
            )
            await self._setup.world.transactions.complete(tx.reference_id, ENROLLED)
            self.enrolled.append(record.face_id)

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        await self._inner.add(entries)

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        return await self._inner.search(tenant_id, embedding, limit, min_similarity)

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None:
        await self._inner.delete(tenant_id, face_ids)

    async def page_ids(
        self, tenant_id: str, after: str | None, limit: int, *, all_versions: bool = False
    ) -> tuple[list[str], str | None]:
        await self._enrol()
        return await self._inner.page_ids(tenant_id, after, limit, all_versions=all_versions)

    async def present(
        self, tenant_id: str, face_ids: Sequence[str], *, all_versions: bool = False
    ) -> set[str]:
        return await self._inner.present(tenant_id, face_ids, all_versions=all_versions)


def test_a_face_enrolled_while_the_pass_reads_is_kept() -> None:
    async def scenario() -> None:
        setup = Setup(grace_s=0)
        await setup.world.enrol("tenant-a", "fearlier", embedding(1))
        racing = EnrolWhenScanned(setup, setup.world.gallery)
        await setup.run(gallery=racing)
        await setup.run()
        (face_id,) = racing.enrolled
        assert face_id in setup.world.gallery.face_ids("tenant-a")
        assert await setup.world.record_store.get("tenant-a", face_id) is not None

    run(scenario)


def test_a_consistent_gallery_is_left_untouched_and_read_in_batches() -> None:
    async def scenario() -> None:
        setup = Setup(grace_s=0, batch=2)
        for index in range(5):
            await setup.world.enrol(f"tenant-{index % 2}", f"face-{index}", embedding(index))
        before_blobs = dict(setup.world.blobs.items)
        report = await setup.run()
        assert (report.records, report.vectors, report.vectors_removed, report.records_removed) == (
            5,
            5,
            0,
            0,
        )
        assert report.suspects == 0
        calls = dict(setup.world.faults.calls)
        assert setup.world.gallery.pairs() == await setup.world.record_store.all_face_ids()
        assert setup.world.blobs.items == before_blobs
        assert calls.get("gallery.delete", 0) == calls.get("records.delete", 0) == 0
        # Never the whole gallery at once: pages of `batch` ids (3 + 2 per side for 3 + 2 faces).
        assert calls.get("records.all_face_ids", 0) == 0
        assert calls["gallery.page_ids"] == calls["records.page"] == 2 + 2

    run(scenario)


def test_records_of_another_model_version_are_left_alone() -> None:
    async def scenario() -> None:
        setup = Setup(grace_s=0)
        tx = await setup.transaction("tenant-a")
        await setup.world.transactions.complete(tx.reference_id, ENROLLED)
        old = setup.record(tx, version="unit-test-v1")
        await setup.world.record_store.put(old)
        report = await setup.run()
        assert (report.records_removed, report.records_other_version, report.suspects) == (0, 1, 0)
        assert await setup.world.record_store.get("tenant-a", old.face_id) == old

    run(scenario)


def test_one_pass_at_a_time_and_a_dead_holders_lease_expires() -> None:
    async def scenario() -> None:
        setup = Setup()
        await setup.world.enrol("tenant-a", "face", embedding(1))
        assert await setup.state.acquire("crashed-worker", 60)
        assert await setup.reconciler("other").run_pass() is None
        setup.clock.advance(61)  # the crashed worker never renewed
        report = await setup.reconciler("other").run_pass()
        assert report is not None and report.completed
        assert setup.state.lease is None  # released at the end

    run(scenario)


def test_a_pass_that_loses_its_lease_is_resumed_where_it_stopped() -> None:
    async def scenario() -> None:
        setup = Setup(grace_s=0, batch=1)
        for index in range(4):
            await setup.world.enrol("tenant-a", f"face-{index}", embedding(index))
        setup.state.renewals_left = 2  # records phase: two batches saved, then the lease is gone
        interrupted = await setup.reconciler("first").run_pass()
        assert interrupted is not None and not interrupted.completed
        assert setup.state.cursor is not None and setup.state.last is None

        setup.state.renewals_left = None
        resumed = await setup.run("second")
        assert resumed.resumed
        # Nothing skipped; the one batch whose checkpoint found the lease gone is read again (its cursor was
        # never written: a checkpoint renews first).
        assert (interrupted.records, resumed.records) == (3, 2)
        assert resumed.vectors == 4
        assert setup.state.cursor is None and setup.state.last == setup.clock()

    run(scenario)


def test_replicas_share_one_pass_per_interval() -> None:
    async def scenario() -> None:
        setup = Setup()
        await setup.run()
        assert await setup.reconciler("replica-2").run_pass(min_interval_s=600) is None
        setup.clock.advance(600)
        assert await setup.reconciler("replica-2").run_pass(min_interval_s=600) is not None

    run(scenario)


def test_orphaned_blobs_older_than_the_grace_period_are_swept_and_referenced_ones_kept() -> None:
    async def scenario() -> None:
        from serve_app.pipelines.commands import FaceSearchCommand
        from tests.unit.fakes import solid_png

        setup = Setup(blob_sweep=True)
        world = setup.world
        proof = await world.enrol("tenant-a", "whole", embedding(1))
        queued = await world.transaction_service().create_face_search(
            FaceSearchCommand("tenant-a", solid_png((1, 2, 3)), None, allow_override=False, enroll_face=True)
        )
        await world.blobs.put("uploads/tenant-a/never-enqueued", b"x", "image/png")  # ingress crashed
        await world.blobs.put("uploads/tenant-a/fresh-orphan", b"x", "image/png")
        for key in (proof.proof_key, queued.image_key, "uploads/tenant-a/never-enqueued"):
            world.blobs.written_at[key] -= 7200

        report = await setup.run()
        assert report.blobs_removed == 1
        assert set(world.blobs.items) == {proof.proof_key, queued.image_key, "uploads/tenant-a/fresh-orphan"}

    run(scenario)

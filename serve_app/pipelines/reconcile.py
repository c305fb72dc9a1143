"""Repair faces that exist on only one side of Redis (records) and Milvus (vectors), without ever deleting
a face that is being enrolled.

Who writes what, in which order:
- enrolment (processing._add): the record, then the vector, then the transaction becomes final. Faces with
  a client_reference do both writes under the reference's lock; faces without one take no lock.
- removal (delete, erasure, override): the vector (from the collection of every model version), then the
  record, then the proof image.
- re-indexing: under the face's lock (FaceRecord.lock_subject), a vector of the current version for a
  record it has just re-read, then the record.
- face ids are "f" + the reference id of the transaction that enrols them, and only the processing of that
  transaction ever writes that face's record.

Nothing is decided from one snapshot. A pass walks each tenant in bounded batches and notes inconsistent
faces as suspects (in the ReconcileState, with the time first seen); a suspect is repaired only when a
later re-check, at least `grace_s` after it was first seen, still finds it inconsistent:

Vectors without a record. The scan reads the vectors of every model version the gallery holds (a vector an
older version enrolled outlives a re-index in its own collection, and a removal interrupted before it
reached every collection leaves such copies), and a repair deletes the face from all of them. Each batch
reads the vectors first and their records second. A vector is written after its record, so a record read
after its vector was seen is found, unless a removal took it: the race of reading records before vectors (a
face enrolled between the two reads looked like debris and lost its vector) cannot happen in this order. The
re-check after the grace period reads the face's transaction first: while it is not final, an attempt may
still write the face, and the suspect waits. Then, under the reference's lock (the transaction names the
client_reference; the vector does not), the record is read again and the vector is deleted only if it is
still absent. Under the lock no enrolment of that reference is between its two writes, and one that starts
later writes its record and then its vector again, so the deletion cannot undo it. A face enrolled without a
client_reference takes its own lock (FaceRecord.lock_subject), which only a re-index or a deletion of it
takes too; its enrolment takes none, and for that the re-read is sufficient on its own because its only
enrolling writer is its own transaction, which the re-check found final before reading the record: a final
transaction is never processed again (mark_processing refuses it), and an attempt that began before it
became final (a worker presumed dead whose entry was reclaimed) is bounded by the worker's deadlines, far
shorter than the grace period. A transaction that is gone (expired after its retention period, or a face id
not derived from one) has no writer at all.

Records without a vector. The re-check reads the transaction first and the vector second. Once the
transaction is final its attempt has written the vector (the vector precedes completion), so a vector still
absent when read after that is truly missing: the enrolment was given up between its two writes, or the
vector was lost. Such a record and its proof image are removed, under the reference's lock when it has one,
and with them any vector of the face an older model version left behind (so no copy outlives it). A record
of another face model version (a gallery enrolled before an upgrade) has its vector in that version's own
collection, not in this one: it is left alone (kept for re-indexing, never searched).

Scale: one pass at a time across the cluster (the "reconcile" job of pipelines/jobs.py: a lease that
expires when its holder dies, renewed after every batch, and a cursor written only by the lease's holder);
tenants and faces are walked in face id order with cursors (records' sorted index, Milvus' query iterator),
and the cursor is saved after every batch, so a pass interrupted by a crash is resumed by the next holder.
A holder that lost the lease (it was paused past its expiry) stops at its next renewal and never overwrites
the cursor of the holder that took over. Memory is one batch of ids, whatever the size of the gallery.

Every repair takes the face's lock and removes through FaceLifecycle (pipelines/lifecycle.py), in the
order every removal uses.

Given an orphan grace period, the pass ends with the sweep of orphaned blobs (pipelines/blob_sweep.py),
under the same lease and cursor, a page of blobs at a time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve_app.domain.faces import lock_subject
from serve_app.domain.identifiers import reference_id_of_face
from serve_app.domain.transactions import Transaction
from serve_app.pipelines.blob_sweep import BlobSweep, SweepReport
from serve_app.pipelines.jobs import JobPass, LeasedJob, LeaseLost
from serve_app.pipelines.lifecycle import FaceLifecycle
from serve_app.stores.interfaces import (
    BlobStore,
    FaceRecordStore,
    GalleryStore,
    LockPolicy,
    ReconcileState,
    TransactionStore,
)

logger = logging.getLogger(__name__)

VECTOR = "vector"  # suspect kinds: a vector without a record, a record without a vector
RECORD = "record"


@dataclass(frozen=True)
class ReconcilePolicy:
    lock: LockPolicy  # a face's lock (its client_reference's, or its own), as every writer takes it
    grace_s: float = 600.0  # how long a face must stay inconsistent before it is repaired
    batch: int = 1000  # ids per read: the pass's memory, whatever the gallery's size
    lease_s: float = 120.0  # a holder that stops renewing (it died) loses the lease after this
    model_version: str | None = None  # the gallery's version; records of others are not its business
    orphan_grace_s: float | None = None  # None: no blob sweep


@dataclass
class ReconcileReport:
    records: int = 0  # records read by this pass
    vectors: int = 0  # vectors read by this pass
    vectors_removed: int = 0
    records_removed: int = 0
    suspects: int = 0  # faces seen inconsistent and not (yet) repaired: in their grace period or in flight
    blobs_removed: int = 0
    blobs_kept_unnamed: int = 0  # old blobs stored before their key was recorded: kept
    records_other_version: int = 0
    completed: bool = False  # False: the lease was lost before the end; the next holder resumes
    resumed: bool = False  # continued a pass an earlier holder left unfinished


@dataclass
class _Cursor:
    tenant: str
    phase: str  # "records", "vectors", "suspects" (their re-check), then "done"; or "blobs": the sweep
    after: str | None = None

    def dump(self) -> str:
        return json.dumps({"tenant": self.tenant, "phase": self.phase, "after": self.after})

    @classmethod
    def load(cls, raw: str) -> _Cursor | None:
        try:
            data = json.loads(raw)
            return cls(str(data["tenant"]), str(data["phase"]), data.get("after"))
        except (ValueError, KeyError, TypeError):
            return None  # written by another version: start the pass again


_PHASES = ("records", "vectors", "suspects", "done")
_BLOBS = "blobs"  # after every tenant; its `after` is the blob store's cursor
_CURSOR = "cursor"  # the job's fields
_LAST_PASS = "last-pass"


@dataclass
class Reconciler:
    records: FaceRecordStore
    gallery: GalleryStore
    transactions: TransactionStore
    state: ReconcileState
    holder: str  # this process' name on the lease
    policy: ReconcilePolicy
    blobs: BlobStore
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self._faces = FaceLifecycle(self.records, self.gallery, self.blobs, self.policy.lock)

    async def run_pass(self, min_interval_s: float = 0.0) -> ReconcileReport | None:
        """One pass over every tenant, or the rest of an interrupted one. None when another process holds
        the lease, or when the last pass completed less than min_interval_s ago (replicas that each try
        every min_interval_s then share one pass per interval)."""
        async with LeasedJob(self.state, self.holder, self.policy.lease_s).hold() as job:
            if job is None:
                return None
            raw = await job.read(_CURSOR)
            cursor = _Cursor.load(raw) if raw is not None else None
            if cursor is None and min_interval_s > 0:
                last = await self.state.last_completed()
                if last is not None and self.clock() - last < min_interval_s:
                    return None
            report = ReconcileReport(resumed=cursor is not None)
            try:
                if cursor is None or cursor.phase != _BLOBS:
                    await self._walk(job, cursor, report)
                    cursor = None
                await self._sweep_blobs(job, cursor.after if cursor is not None else None, report)
                await job.checkpoint({_LAST_PASS: repr(self.clock()), _CURSOR: None})
            except LeaseLost:
                logger.warning("reconciliation lost its lease; the next holder resumes the pass")
                return report
            report.completed = True
            return report

    async def _walk(self, job: JobPass, cursor: _Cursor | None, report: ReconcileReport) -> None:
        tenants = await self.records.tenant_ids()
        for tenant in tenants:
            if cursor is not None and tenant < cursor.tenant:
                continue  # done by the holder that left the cursor
            resume = cursor if cursor is not None and tenant == cursor.tenant else None
            start = _PHASES.index(resume.phase) if resume is not None and resume.phase in _PHASES else 0
            for index, phase in enumerate(_PHASES[start:-1], start):
                after = resume.after if resume is not None and resume.phase == phase else None
                if phase == "records":
                    await self._scan_records(job, tenant, after, report)
                elif phase == "vectors":
                    await self._scan_vectors(job, tenant, after, report)
                else:
                    await self._recheck(job, tenant, report)
                await self._checkpoint(job, _Cursor(tenant, _PHASES[index + 1]))
            cursor = None

    @staticmethod
    async def _checkpoint(job: JobPass, cursor: _Cursor) -> None:
        # Renews first, then writes the cursor only while the lease is still this holder's.
        await job.checkpoint({_CURSOR: cursor.dump()})

    def _current(self, model_version: str) -> bool:
        return self.policy.model_version is None or model_version == self.policy.model_version

    async def _scan_records(
        self, job: JobPass, tenant: str, after: str | None, report: ReconcileReport
    ) -> None:
        while True:
            page, after = await self.records.page(tenant, after, self.policy.batch)
            report.records += len(page)
            current = [record.face_id for record in page if self._current(record.model_version)]
            report.records_other_version += len(page) - len(current)
            with_vector = await self.gallery.present(tenant, current)
            missing = [face_id for face_id in current if face_id not in with_vector]
            await self.state.add_suspects(RECORD, tenant, missing, self.clock())
            if after is None:
                return
            await self._checkpoint(job, _Cursor(tenant, "records", after))

    async def _scan_vectors(
        self, job: JobPass, tenant: str, after: str | None, report: ReconcileReport
    ) -> None:
        while True:
            # Vectors first, their records second: see the module docstring.
            face_ids, after = await self.gallery.page_ids(tenant, after, self.policy.batch, all_versions=True)
            report.vectors += len(face_ids)
            found = await self.records.get_many(tenant, face_ids)
            missing = [face_id for face_id in face_ids if face_id not in found]
            await self.state.add_suspects(VECTOR, tenant, missing, self.clock())
            if after is None:
                return
            await self._checkpoint(job, _Cursor(tenant, "vectors", after))

    async def _recheck(self, job: JobPass, tenant: str, report: ReconcileReport) -> None:
        seen_before = self.clock() - self.policy.grace_s
        for kind, repair in ((VECTOR, self._repair_vector), (RECORD, self._repair_record)):
            kept = 0  # suspects left in place come first in the next batch: skip them
            while True:
                due = await self.state.due_suspects(kind, tenant, seen_before, kept, self.policy.batch)
                settled: list[str] = []
                for face_id in due:
                    outcome = await repair(tenant, face_id)
                    if outcome is None:
                        kept += 1
                        continue
                    settled.append(face_id)
                    if outcome:
                        if kind == VECTOR:
                            report.vectors_removed += 1
                        else:
                            report.records_removed += 1
                await self.state.drop_suspects(kind, tenant, settled)
                if len(due) < self.policy.batch:
                    break
                await job.renew()
            report.suspects += await self.state.count_suspects(kind, tenant)

    async def _transaction(self, face_id: str) -> tuple[bool, Transaction | None]:
        """(whether the face's transaction may still write it, the transaction)."""
        reference_id = reference_id_of_face(face_id)
        tx = await self.transactions.get(reference_id) if reference_id is not None else None
        return (tx is not None and not tx.state.is_final), tx

    async def _repair_vector(self, tenant: str, face_id: str) -> bool | None:
        """True: the debris vector was deleted; False: consistent now; None: not decidable yet."""
        in_flight, tx = await self._transaction(face_id)
        if in_flight:
            return None
        # Consistent again: no need for the lock (finding a face whole never deletes anything).
        if await self.records.get(tenant, face_id) is not None:
            return False
        subject = lock_subject(face_id, tx.client_reference if tx is not None else None)
        async with self._faces.locked(tenant, subject) as lock:
            if await self.records.get(tenant, face_id) is not None:
                return False
            if not await self.gallery.present(tenant, [face_id], all_versions=True):
                return False
            await self._faces.remove_by_id(tenant, face_id, None, lock)  # from every version's collection
        logger.info("reconciliation: deleted the vector of %s/%s, which has no record", tenant, face_id)
        return True

    async def _repair_record(self, tenant: str, face_id: str) -> bool | None:
        """True: the orphaned record was removed; False: consistent now; None: not decidable yet."""
        in_flight, _ = await self._transaction(face_id)
        if in_flight:
            return None
        # Transaction final (read above), then the vector: see the module docstring.
        record = await self.records.get(tenant, face_id)
        if (
            record is None
            or not self._current(record.model_version)
            or await self.gallery.present(tenant, [face_id])
        ):
            return False
        async with self._faces.locked(tenant, record.lock_subject) as lock:
            if await self.gallery.present(tenant, [face_id]):
                return False
            record = await self.records.get(tenant, face_id)
            if record is None:
                return False
            # With copies an older model version left behind, and its proof.
            await self._faces.remove([record], lock)
        logger.info("reconciliation: removed the record of %s/%s, which has no vector", tenant, face_id)
        return True

    async def _sweep_blobs(self, job: JobPass, after: str | None, report: ReconcileReport) -> None:
        if self.policy.orphan_grace_s is None:
            return
        sweep = BlobSweep(
            self.blobs, self.records, self.transactions, self.policy.orphan_grace_s, self.policy.batch
        )
        swept = SweepReport()
        try:
            await sweep.run(after, lambda cursor: self._checkpoint(job, _Cursor("", _BLOBS, cursor)), swept)
        finally:
            report.blobs_removed += swept.removed
            report.blobs_kept_unnamed += swept.kept_unnamed

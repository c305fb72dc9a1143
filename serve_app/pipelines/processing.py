"""Finalising one transaction: analyse the stored image, search the tenant's gallery, enrol, record the
result.

Every step is idempotent so a transaction reclaimed after a worker died can simply be processed again:
the enrolled face id is derived from the reference id, writes are upserts, and a final state is never
overwritten.

A transaction's outcome and the gallery agree: `completed` with `enrolled` means its face is searchable,
and `failed` means nothing of it is (see TransactionProcessor.give_up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from models.age_policy import AgeDecision, AgeIntervalRule, decide_age
from models.calibration import DEFAULT_FPIR, FaceScoreCalibration
from models.types import AnalyzedFace, FaceQuality, largest_face
from serve_app.domain.errors import ServiceError
from serve_app.domain.faces import FaceRecord
from serve_app.domain.identifiers import enrolled_face_id as enrolled_face_id  # re-exported: the rule's home
from serve_app.domain.outcomes import (
    AgeDecisionReport,
    AgeEstimationOutcome,
    FaceMatch,
    FaceSearchOutcome,
    Outcome,
    QualityReport,
)
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState
from serve_app.imaging.decode import decode_image
from serve_app.pipelines.analysis import FaceAnalysisBackend
from serve_app.pipelines.lifecycle import FaceLifecycle
from serve_app.stores.interfaces import (
    BlobStore,
    ClientStore,
    FaceRecordStore,
    GalleryStore,
    HeldLock,
    LockPolicy,
    TransactionStore,
)

logger = logging.getLogger(__name__)


class ImageUnusable(ServiceError):
    """The stored image cannot be processed; the transaction fails instead of being retried."""


@dataclass(frozen=True)
class ProcessingPolicy:
    model_version: str
    max_matches: int  # default; a tenant may override it (ClientInfo.max_matches)
    # None: the minimum score follows the tenant's gallery size (FPIR <= fpir); a tenant's own
    # ClientInfo.min_score comes first, then the service-wide one set at run time (ClientStore.
    # default_min_score), then this setting, then the calibrated default.
    min_score: float | None
    max_image_pixels: int
    analysis_max_side: int
    calibration: FaceScoreCalibration
    lock: LockPolicy  # of a client_reference's enrolments (pipelines/lifecycle.py)
    fpir: float = DEFAULT_FPIR
    # A probe below the quality gate's search bar still searches, but cannot produce certainty: it must
    # clear the bar of a ten times lower FPIR, and its scores are capped at low_quality_score_cap (or at
    # that bar, when it is higher), so a client reading the score never sees a confident match.
    low_quality_fpir: float = DEFAULT_FPIR / 10
    low_quality_score_cap: float = 0.5
    tenant_cache_s: float = 5.0  # gallery size and per-tenant settings are re-read at most this often
    # The calibrated age intervals behind under_18 / under_21 (models.age_policy), at the configured rate.
    age_rule: AgeIntervalRule = field(default_factory=AgeIntervalRule.load)


@dataclass(frozen=True)
class _TenantSearch:
    min_score: float | None
    max_matches: int | None
    gallery_size: int
    read_at: float


def quality_report(quality: FaceQuality) -> QualityReport:
    """The measurements a client sees when a face misses a quality bar (the extension fields)."""
    return QualityReport(
        reasons=tuple(quality.reasons) or ("below_search_bar",),
        face_size_px=round(quality.face_size_px, 1),
        detector_score=round(quality.detector_score, 3),
        sharpness=round(quality.sharpness, 1),
        yaw=round(quality.yaw, 3),
        pitch=round(quality.pitch, 3),
        roll_deg=round(quality.roll_deg, 1),
    )


def age_decision_report(decision: AgeDecision, quality: FaceQuality | None) -> AgeDecisionReport | None:
    """The age_decision extension: the reason when a flag is 50, with the subject's measurements and the age
    bar's failed checks when the reason is face quality."""
    if decision.reason is None:
        return None
    report = None
    if decision.reason == "face_quality" and quality is not None:
        report = dataclasses.replace(quality_report(quality), reasons=decision.quality_reasons)
    return AgeDecisionReport(reason=decision.reason, quality=report)


class TransactionProcessor:
    def __init__(
        self,
        transactions: TransactionStore,
        records: FaceRecordStore,
        gallery: GalleryStore,
        blobs: BlobStore,
        analysis: FaceAnalysisBackend,
        policy: ProcessingPolicy,
        clients: ClientStore | None = None,
    ) -> None:
        self._transactions = transactions
        self._records = records
        self._gallery = gallery
        self._blobs = blobs
        self._analysis = analysis
        self._policy = policy
        self._clients = clients
        self._faces = FaceLifecycle(records, gallery, blobs, policy.lock)
        self._tenants: dict[str, _TenantSearch] = {}

    async def process(self, reference_id: str) -> None:
        """Bring one transaction to a final state. Raises on backend failures so the entry stays queued."""
        tx = await self._transactions.mark_processing(reference_id)
        if tx is None:
            return  # unknown or already final: a duplicate delivery
        try:
            image = await self._load_image(tx)
        except ImageUnusable as error:
            # An earlier attempt may have enrolled from this very upload before its worker died: the image
            # is unusable now only if it was removed (an erasure, which took the face too) or the decode
            # limits were lowered between the attempts. Either way the face goes with the failure.
            await self._fail(reference_id, error.message)
            return
        result: Outcome
        if tx.kind is TransactionKind.FACE_SEARCH:
            result = await self._face_search(tx, image)
        else:
            result = await self._age_estimation(tx, image)
        completed = await self._transactions.complete(reference_id, result)
        if not tx.enroll_face or not result.enrolled:
            await self._blobs.delete(tx.image_key)  # nothing refers to the upload any more
            return
        if completed:
            return
        final = await self._transactions.get(reference_id)  # final already: completed by another attempt?
        if final is not None and final.state is TransactionState.FAILED:
            # This attempt outlived its lease (its worker stalled) and the transaction was given up
            # meanwhile; complete() changed nothing. What it enrolled after the give-up is taken back here.
            await self._withdraw(final)

    async def give_up(self, reference_id: str, message: str) -> None:
        """Fail a transaction whose attempts keep failing (or killing their worker), and take back what an
        earlier attempt enrolled: its face's vector, record and proof image.

        An attempt enrols before it completes, so one that died in between leaves the face searchable. The
        outcome and the gallery must then agree one way or the other, and only `failed` can be told
        truthfully: completing instead would need the matches of the search that the dead attempt ran and
        never recorded, and producing them again is exactly what kept failing. A face left behind under a
        failed transaction would be a face the client was told was not stored; it would keep matching,
        and the client's natural retry would enrol the same person a second time. So `failed` means: no
        face of this transaction is in the gallery, and submitting the image again is safe.

        An override (allow_override) is taken back the same way, but what it replaced cannot be restored:
        the new face is written first and the face it replaces removed second, so an attempt that died
        after the removal leaves the client_reference with no face once its own is withdrawn. The error
        then says so, and the client's retry enrols the image as the reference's only face. An attempt
        that died before the removal leaves the earlier face in place, as if the override never ran.
        Serialised with enrolments and erasures of the reference by its lock.

        Idempotent: a give-up interrupted half-way is finished when the entry is delivered again. A
        transaction that completed meanwhile keeps its face."""
        tx = await self._transactions.get(reference_id)
        if tx is not None and not tx.state.is_final and await self._replaced_already(tx):
            message += (
                " The face enrolled earlier under this client_reference had already been replaced and is"
                " no longer stored; submit the image again to enrol it."
            )
        await self._fail(reference_id, message)

    async def _replaced_already(self, tx: Transaction) -> bool:
        """Whether an attempt of this override enrolled its face and removed the one it replaces."""
        if not (tx.allow_override and tx.client_reference):
            return False
        own = await self._records.get(tx.tenant_id, enrolled_face_id(tx.reference_id))
        if own is None or own.replaces is None or own.replaces == own.face_id:
            return False
        return await self._records.get(tx.tenant_id, own.replaces) is None

    async def _fail(self, reference_id: str, message: str) -> None:
        """Fail the transaction (a no-op when it is final already), then, if it did end failed, remove what
        any of its attempts enrolled."""
        await self._transactions.fail(reference_id, message)
        tx = await self._transactions.get(reference_id)
        if tx is not None and tx.state is TransactionState.FAILED:
            await self._withdraw(tx)

    async def _withdraw(self, tx: Transaction) -> None:
        """Remove this transaction's own face (FaceLifecycle.remove_by_id), under the reference's lock, and
        its upload. Only its own: the face an override was to replace is never touched here. Every step is
        a no-op when there is nothing to remove.

        When nothing of the face is stored, the lock is not taken: a transaction given up because its
        attempts kept timing out on a busy reference's lock must not need that lock to end. An attempt
        still running may enrol after this check; it then finds the transaction failed when it tries to
        complete it, and withdraws its face itself (process)."""
        if tx.enroll_face:
            face_id = enrolled_face_id(tx.reference_id)
            if not tx.client_reference:
                await self._faces.remove_by_id(tx.tenant_id, face_id, None, None)
            elif await self._faces.is_stored(tx.tenant_id, face_id):
                async with self._faces.locked(tx.tenant_id, tx.client_reference) as lock:
                    await self._faces.remove_by_id(tx.tenant_id, face_id, None, lock)
        await self._blobs.delete(tx.image_key)  # never used again: not an upload in flight, not a proof

    async def _load_image(self, tx: Transaction) -> Any:
        stored = await self._blobs.get(tx.image_key)
        if stored is None:
            raise ImageUnusable("The uploaded image is no longer available.")
        data, _ = stored
        try:
            decoded = await asyncio.to_thread(
                decode_image, data, self._policy.max_image_pixels, self._policy.analysis_max_side
            )
        except ServiceError as error:
            raise ImageUnusable(error.message) from error
        return decoded.pixels

    async def _tenant_search(self, tenant_id: str) -> _TenantSearch:
        """The tenant's overrides and gallery size, cached briefly (one HGETALL and one SCARD)."""
        now = time.monotonic()
        cached = self._tenants.get(tenant_id)
        if cached is not None and now - cached.read_at < self._policy.tenant_cache_s:
            return cached
        info = await self._clients.get(tenant_id) if self._clients is not None else None
        own = info.min_score if info is not None else None
        # A tenant's own minimum score, else the service-wide one set at run time (ClientStore).
        service_wide = await self._clients.default_min_score() if self._clients and own is None else None
        fresh = _TenantSearch(
            min_score=own if own is not None else service_wide,
            max_matches=info.max_matches if info is not None else None,
            gallery_size=await self._records.count(tenant_id),
            read_at=now,
        )
        if len(self._tenants) > 10_000:
            self._tenants.clear()  # bounded: tenants are few, but never let the cache grow without limit
        self._tenants[tenant_id] = fresh
        return fresh

    def _search_bar(self, tenant: _TenantSearch, low_quality: bool) -> tuple[float, float]:
        """(minimum score, score cap) for one probe."""
        calibration = self._policy.calibration
        if tenant.min_score is not None:
            min_score = tenant.min_score
        elif self._policy.min_score is not None:
            min_score = self._policy.min_score
        else:
            min_score = calibration.min_score_for_gallery(tenant.gallery_size, self._policy.fpir)
        if not low_quality:
            return min_score, 1.0
        stricter = calibration.min_score_for_gallery(tenant.gallery_size, self._policy.low_quality_fpir)
        min_score = max(min_score, stricter)
        return min_score, max(min_score, self._policy.low_quality_score_cap)

    async def _face_search(self, tx: Transaction, image: Any) -> FaceSearchOutcome:
        faces = await self._analysis.analyze(image, embed=True, estimate_age=False)
        probe = largest_face(faces)
        if probe is None or probe.embedding is None:
            return FaceSearchOutcome(is_face_found=False)
        own_face_id = enrolled_face_id(tx.reference_id)
        tenant = await self._tenant_search(tx.tenant_id)
        max_matches = tenant.max_matches or self._policy.max_matches
        low_quality = probe.quality is not None and not probe.quality.search_ok
        min_score, cap = self._search_bar(tenant, low_quality)
        calibration = self._policy.calibration
        # Search before enrolling so the probe never matches itself; a retried transaction may find its own
        # face from the earlier attempt, which is filtered out too.
        matches = await self._gallery.search(
            tx.tenant_id, probe.embedding, max_matches + 1, calibration.cosine_for_score(min_score)
        )
        # client_reference is kept only in the face records (see milvus_gallery); a vector whose record is
        # gone is debris of an interrupted removal, never a match.
        records = await self._records.get_many(tx.tenant_id, [match.face_id for match in matches])
        matched = tuple(
            FaceMatch(
                face_id=match.face_id,
                score=round(min(cap, calibration.score(match.similarity)), 6),
                client_reference=records[match.face_id].client_reference or "",
            )
            for match in matches
            if match.face_id != own_face_id and match.face_id in records
        )[:max_matches]
        probe_quality = quality_report(probe.quality) if low_quality and probe.quality is not None else None
        unindexed, enrolled = await self._enroll_if_good(tx, probe) if tx.enroll_face else ((), False)
        return FaceSearchOutcome(
            is_face_found=True,
            matches=matched,
            probe_quality=probe_quality,
            unindexed_faces=unindexed,
            enrolled=enrolled,
        )

    async def _enroll_if_good(
        self, tx: Transaction, face: AnalyzedFace
    ) -> tuple[tuple[QualityReport, ...], bool]:
        """Enrol the face unless it misses the quality gate's enrolment bar; then, like AWS IndexFaces'
        UnindexedFaces, the result says which face was not stored and why. Returns (unindexed faces,
        whether the face was enrolled)."""
        if face.quality is not None and not face.quality.enrol_ok:
            return (quality_report(face.quality),), False
        enrolled = await self._enroll(tx, face)
        if enrolled:
            self._tenants.pop(tx.tenant_id, None)  # the gallery grew: re-read its size next time
        return (), enrolled

    async def _age_estimation(self, tx: Transaction, image: Any) -> AgeEstimationOutcome:
        faces = await self._analysis.analyze(image, embed=tx.enroll_face, estimate_age=True)
        subject = largest_face(faces)
        # The flags follow models.age_policy (a calibrated interval per flag, widened by the face's quality;
        # another face that could be a minor), which also says why a flag is 50.
        decision = decide_age(faces, self._policy.age_rule)
        if subject is None or decision is None:
            return AgeEstimationOutcome(age=None, under_18=None, under_21=None)
        unindexed: tuple[QualityReport, ...] = ()
        enrolled = False
        if tx.enroll_face and subject.embedding is not None:
            unindexed, enrolled = await self._enroll_if_good(tx, subject)
        return AgeEstimationOutcome(
            age=decision.estimate.age,
            under_18=decision.under_18,
            under_21=decision.under_21,
            unindexed_faces=unindexed,
            enrolled=enrolled,
            age_decision=age_decision_report(decision, subject.quality),
        )

    async def _enroll(self, tx: Transaction, face: AnalyzedFace) -> bool:
        """Enrol the face; False when an override was superseded by a later submission, or the reference
        was erased after the transaction was accepted."""
        assert face.embedding is not None
        record = FaceRecord(
            face_id=enrolled_face_id(tx.reference_id),
            tenant_id=tx.tenant_id,
            client_reference=tx.client_reference,
            proof_key=tx.image_key,
            model_version=self._policy.model_version,
            created_at=tx.created_at,
            reference_id=tx.reference_id,
        )
        if tx.client_reference:
            # Serialise enrolments under one client_reference: concurrent overrides leave exactly one
            # image, and an erasure of the reference (pipelines/gallery.py) never interleaves with the
            # writes of an enrolment, which would leave a vector without its record.
            async with self._faces.locked(tx.tenant_id, tx.client_reference) as lock:
                erased_at = await self._records.erased_at(tx.tenant_id, tx.client_reference)
                if erased_at is not None and erased_at >= tx.created_at:
                    # Accepted before the reference was erased: erasure means erased, so the face is
                    # not enrolled (the result says enrolled: false) and its upload is dropped.
                    return False
                if tx.allow_override:
                    return await self._override(record, face, lock)
                await self._faces.enrol(record, face.embedding, lock)
                return True
        await self._faces.enrol(record, face.embedding, None)
        return True

    async def _override(self, record: FaceRecord, face: AnalyzedFace, lock: HeldLock) -> bool:
        assert record.client_reference is not None
        current = await self._transactions.get(record.reference_id)
        if current is not None and current.state is TransactionState.FAILED:
            # Given up while this attempt waited (its worker stalled past its lease): the give-up keeps the
            # reference's earlier face, so a late attempt must not remove it. Under the reference's lock,
            # as the give-up's withdrawal is.
            return False
        earlier_attempt = await self._records.get(record.tenant_id, record.face_id)
        if earlier_attempt is not None:
            # A retry: keep the decision the first attempt recorded.
            replaces = earlier_attempt.replaces
        else:
            latest = await self._records.latest_for_reference(record.tenant_id, record.client_reference)
            if latest is not None and latest.created_at > record.created_at:
                return False  # a later submission already replaced this reference's image
            replaces = latest.face_id if latest is not None else None
        assert face.embedding is not None
        # A crash between the new face's writes and the removal below leaves the record naming the face it
        # replaces: the retry reads that decision back (earlier_attempt) and finishes the removal.
        await self._faces.enrol(dataclasses.replace(record, replaces=replaces), face.embedding, lock)
        if replaces is not None and replaces != record.face_id:
            await self._remove_replaced(record.tenant_id, replaces, lock)
        return True

    async def _remove_replaced(self, tenant_id: str, face_id: str, lock: HeldLock) -> None:
        """Remove the face an override replaces, and those it had replaced itself if an earlier override
        crashed before removing them, under the reference's lock (they share the reference)."""
        doomed: list[FaceRecord] = []
        next_id: str | None = face_id
        while next_id is not None and (previous := await self._records.get(tenant_id, next_id)) is not None:
            doomed.append(previous)
            next_id = previous.replaces if previous.replaces not in {p.face_id for p in doomed} else None
        # The oldest first, as one removal each did before: the newest stays until its predecessors went.
        for previous in reversed(doomed):
            await self._faces.remove([previous], lock)

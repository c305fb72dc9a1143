"""Re-embed a tenant's enrolled faces with the serving face model (`facesearch reindex --tenant ID`).

What can be re-indexed: every face record keeps its proof, the original upload, in the blob store; that
image is decoded and analysed again exactly as a face search does (largest face, current model), and the
vector joins the current version's collection under the same face_id. The face record then names the
current version. A face whose proof is gone, or in which the current model finds no face, cannot be
re-indexed: it stays in its old version's collection, unsearched, and is reported.

Order of writes: vector first, record second (FaceLifecycle.reindex), both under the lock every remover of the
face takes (FaceRecord.lock_subject: a deletion, an erasure or an override of its reference), after re-reading
the record there. Without the lock, a face erased between the re-read and the record write came back as a
listed record of the erased reference. A crash between the two writes leaves a current-version vector whose
record still names the old version: searches already find it (the record exists), reconciliation keeps it (it
has a record), and the next run rewrites both. The reverse order would leave a current-version record without
a vector, which reconciliation deletes with its proof.

Resumable: a record that already names the current version is skipped, so a rerun continues where an
interrupted one stopped. Faces that could not be re-indexed are listed in a small JSON state file, so a
rerun does not analyse them again (delete the file to retry them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from models.analyzer import largest_face
from serve_app.domain.errors import ServiceError
from serve_app.domain.faces import FaceRecord, GalleryEntry
from serve_app.imaging.decode import decode_image
from serve_app.pipelines.analysis import FaceAnalysisBackend
from serve_app.pipelines.lifecycle import FaceLifecycle
from serve_app.stores.interfaces import BlobStore, FaceRecordStore, GalleryStore, LockPolicy


@dataclass
class ReindexState:
    """Faces a run could not re-index (face_id -> reason), kept in a JSON file between runs."""

    path: Path
    unusable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ReindexState:
        if not path.is_file():
            return cls(path)
        data = json.loads(path.read_text())
        return cls(path, {str(k): str(v) for k, v in dict(data.get("unusable", {})).items()})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"unusable": self.unusable}, indent=1, sort_keys=True))
        os.replace(temporary, self.path)  # atomic: an interrupted save never leaves half a file


@dataclass(frozen=True)
class ReindexReport:
    tenant_id: str
    model_version: str
    faces: int  # the tenant's face records
    reindexed: int  # re-embedded by this run
    already_current: int  # named the current version before this run
    unusable: dict[str, str]  # face_id -> why it could not be re-indexed (this run and earlier ones)


@dataclass(frozen=True)
class ImageLimits:
    max_image_pixels: int
    analysis_max_side: int


async def reindex_tenant(
    tenant_id: str,
    *,
    records: FaceRecordStore,
    gallery: GalleryStore,
    blobs: BlobStore,
    analysis: FaceAnalysisBackend,
    model_version: str,
    limits: ImageLimits,
    state: ReindexState,
    lock: LockPolicy,
    on_face: Callable[[], None] = lambda: None,
) -> ReindexReport:
    """on_face is called after each face is dealt with (a progress bar's tick). The tenant's records are
    read a page at a time, in face id order."""
    faces = FaceLifecycle(records, gallery, blobs, lock)
    seen = reindexed = current = 0
    after: str | None = None
    while True:
        page, after = await records.page(tenant_id, after, 500)
        for record in page:
            seen += 1
            if record.model_version == model_version:
                current += 1
            elif record.face_id not in state.unusable:
                problem = await _reindex_one(record, records, faces, blobs, analysis, model_version, limits)
                if problem is None:
                    reindexed += 1
                else:
                    state.unusable[record.face_id] = problem
                    state.save()
            on_face()
        if after is None:
            return ReindexReport(tenant_id, model_version, seen, reindexed, current, dict(state.unusable))


async def _reindex_one(
    record: FaceRecord,
    records: FaceRecordStore,
    faces: FaceLifecycle,
    blobs: BlobStore,
    analysis: FaceAnalysisBackend,
    model_version: str,
    limits: ImageLimits,
) -> str | None:
    """Re-embed one face; None when done, else why it cannot be."""
    stored = await blobs.get(record.proof_key)
    if stored is None:
        return "proof image missing"
    try:
        decoded = await asyncio.to_thread(
            decode_image, stored[0], limits.max_image_pixels, limits.analysis_max_side
        )
    except ServiceError as error:
        return f"proof image unreadable: {error.message}"
    face = largest_face(await analysis.analyze(decoded.pixels, embed=True, estimate_age=False))
    if face is None or face.embedding is None:
        return "no face found by the current model"
    entry = GalleryEntry(record.face_id, record.tenant_id, model_version, face.embedding, record.created_at)
    async with faces.locked(record.tenant_id, record.lock_subject) as lock:
        current = await records.get(record.tenant_id, record.face_id)
        if current is None:
            # Removed (an override, a deletion, an erasure) while this face was analysed: never bring it back.
            return "removed while re-indexing"
        await faces.reindex(dataclasses.replace(current, model_version=model_version), entry, lock)
    return None

"""Enrolled faces and search matches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FaceRecord:
    """Metadata of an enrolled face; its vector lives in the gallery (Milvus) under the same face_id."""

    face_id: str
    tenant_id: str
    client_reference: str | None
    proof_key: str  # blob-store key of the enrolled proof image
    model_version: str
    created_at: float
    reference_id: str  # the transaction that enrolled it
    # An override's record names the face it replaces, so a retry after a crash finishes that removal.
    replaces: str | None = None

    @property
    def lock_subject(self) -> str:
        """What writers of this face serialise on (FaceRecordStore.reference_lock): its client_reference,
        whose enrolments, overrides and erasures take the same lock, or, for a face enrolled without one,
        the face itself, in a form no client_reference can take (references refuse control characters)."""
        return lock_subject(self.face_id, self.client_reference)


def lock_subject(face_id: str, client_reference: str | None) -> str:
    """FaceRecord.lock_subject for a face known by its id and reference alone (a vector whose record is
    gone, named by its transaction)."""
    return client_reference if client_reference is not None else f"\x00face:{face_id}"


@dataclass(frozen=True)
class GalleryEntry:
    # No client_reference: it lives only in the face record (Redis) and is joined by face_id at search
    # time, so user text of any length never meets Milvus' VARCHAR byte limits.
    face_id: str
    tenant_id: str
    model_version: str
    embedding: np.ndarray  # float32 unit vector of the gallery's model version
    created_at: float


@dataclass(frozen=True)
class GalleryMatch:
    face_id: str
    similarity: float  # cosine between the probe's and the enrolled face's vectors (same model version)

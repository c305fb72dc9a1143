"""Transactions: what a create call persists and a worker finalises."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from serve_app.domain.identifiers import new_reference_id as new_reference_id  # re-exported
from serve_app.domain.outcomes import Outcome

_UPLOADS = "uploads"


def upload_key(tenant_id: str, reference_id: str) -> str:
    """The blob key of a transaction's upload (a stored transaction leaves it out when it is this one)."""
    return f"{_UPLOADS}/{tenant_id}/{reference_id}"


def upload_owner(key: str) -> tuple[str, str] | None:
    """(tenant id, reference id) of the transaction whose upload_key this is; None for another key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != _UPLOADS or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


class TransactionKind(StrEnum):
    FACE_SEARCH = "face_search"
    AGE_ESTIMATION = "age_estimation"


class TransactionState(StrEnum):
    QUEUED = "queued"  # persisted and on the work queue
    PROCESSING = "processing"  # a worker has claimed it
    COMPLETED = "completed"  # final: result holds the outcome
    FAILED = "failed"  # final: error says why (e.g. the stored image could not be processed)

    @property
    def is_final(self) -> bool:
        return self in (TransactionState.COMPLETED, TransactionState.FAILED)


@dataclass
class Transaction:
    reference_id: str
    tenant_id: str
    kind: TransactionKind
    state: TransactionState
    created_at: float
    updated_at: float
    image_key: str  # blob-store key of the uploaded image
    enroll_face: bool
    allow_override: bool = False
    client_reference: str | None = None
    attempts: int = 0
    # Final outcome (a FaceSearchOutcome or AgeEstimationOutcome, as the kind says). Proof URLs are minted
    # when the result is read, not stored, because each URL expires 15 minutes after it is issued.
    result: Outcome | None = None
    error: str | None = None

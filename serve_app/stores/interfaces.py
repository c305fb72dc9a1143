"""The store interfaces the pipelines and API depend on. Implementations: redis_*.py, milvus_gallery.py,
blobs.py. Unit tests of the logic above may fake these; integration tests use the real servers.

Every method that talks to a backend raises serve_app.domain.errors.BackendUnavailable when the backend
cannot be reached, so callers never see redis/pymilvus exception types.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from serve_app.domain.faces import FaceRecord, GalleryEntry, GalleryMatch
from serve_app.domain.gallery import AuditEntry, GalleryCounts
from serve_app.domain.outcomes import Outcome
from serve_app.domain.transactions import Transaction


@dataclass(frozen=True)
class QueueEntry:
    entry_id: str  # stream entry id, needed to acknowledge
    reference_id: str
    deliveries: int  # how many times this entry has been handed to a consumer


class TransactionStore(Protocol):
    async def create_and_enqueue(self, tx: Transaction) -> None:
        """Persist the transaction and put it on the work queue atomically (one MULTI/EXEC)."""

    async def get(self, reference_id: str) -> Transaction | None: ...

    async def mark_processing(self, reference_id: str) -> Transaction | None:
        """Move QUEUED/PROCESSING → PROCESSING, bump attempts; None if unknown or already final."""

    async def complete(self, reference_id: str, result: Outcome) -> None: ...

    async def fail(self, reference_id: str, error: str) -> None: ...

    async def wait_final(
        self, reference_id: str, timeout_s: float, *, seen_pending: bool = False
    ) -> Transaction | None:
        """Return the transaction once final, or its latest state when timeout_s passes. seen_pending: the
        caller has just read it, not final, so the store need not read it again before waiting."""

    async def count_by_state(self) -> dict[str, int]: ...

    async def image_keys_in_flight(self) -> set[str]:
        """Blob keys of the uploads of transactions not yet acknowledged on the work queue."""


class WorkQueue(Protocol):
    async def claim(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        """New entries for this consumer (consumer group semantics)."""

    async def reclaim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[QueueEntry]:
        """Entries delivered to a consumer that has not acknowledged them for min_idle_ms (it died)."""

    async def renew(self, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        """Renew this consumer's lease on entries it is still working on: their idle time restarts, their
        delivery count does not grow. Returns the ids it still holds; one another consumer reclaimed
        meanwhile is left to that consumer."""

    async def ack(self, entry_ids: Sequence[str]) -> None: ...

    async def requeue(self, entry: QueueEntry) -> None:
        """Put the transaction back as a new, never-delivered entry and drop the old one, atomically: used
        when a backend outage (not the transaction) made an attempt fail, so outages never count towards
        the poison-message limit."""

    async def depth(self) -> int:
        """Entries not yet acknowledged (pending + undelivered)."""


class FaceRecordStore(Protocol):
    async def put(self, record: FaceRecord) -> None: ...

    async def get(self, tenant_id: str, face_id: str) -> FaceRecord | None: ...

    async def get_many(self, tenant_id: str, face_ids: Sequence[str]) -> dict[str, FaceRecord]: ...

    async def latest_for_reference(self, tenant_id: str, client_reference: str) -> FaceRecord | None: ...

    async def delete(self, tenant_id: str, face_id: str) -> None: ...

    async def count(self, tenant_id: str) -> int:
        """How many faces the tenant has enrolled (one set cardinality: cheap)."""

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        """(tenant_id, face_id) of every record (the whole set in memory: small galleries and tests)."""

    async def tenant_ids(self) -> list[str]:
        """Every tenant that has ever had a face record, sorted."""

    def reference_lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> Any:
        """Async context manager: a distributed lock serialising enrolments, overrides and erasures of one
        client_reference."""

    async def page(
        self, tenant_id: str, after: str | None, limit: int
    ) -> tuple[list[FaceRecord], str | None]:
        """Up to `limit` of the tenant's records in face_id order, starting after the face id `after`, and
        the cursor (a face id) to continue from, None at the end. The order is by face id, so faces
        enrolled or deleted meanwhile never make a page repeat or skip a face that stays."""

    async def records_for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        """Every record of the tenant enrolled under this client_reference, in face_id order."""

    async def counts(self, tenant_id: str) -> GalleryCounts: ...


class GalleryStore(Protocol):
    async def add(self, entries: Sequence[GalleryEntry]) -> None: ...

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        """Most similar enrolled faces of this tenant and the store's model version only, best first, with
        cosine similarity >= min_similarity."""

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None: ...

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]: ...

    async def page_ids(self, tenant_id: str, after: str | None, limit: int) -> tuple[list[str], str | None]:
        """Up to `limit` of the tenant's face ids in face_id order, after the face id `after`, and the cursor
        to continue from (None at the end): a scan in bounded batches that can resume in another process."""

    async def present(self, tenant_id: str, face_ids: Sequence[str]) -> set[str]:
        """Which of these face ids have a vector."""

    async def count(self) -> int: ...


class ReconcileState(Protocol):
    """Reconciliation's own state, shared by every process that may run it (pipelines/reconcile.py): the
    lease that lets one pass run at a time, the resumable cursor of the pass, the faces seen inconsistent
    and when first, and when the last pass completed."""

    async def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        """Take the lease (or keep it, when `holder` has it already) for ttl_s; False when another holds
        it. A holder that stops renewing loses it after ttl_s."""

    async def renew_lease(self, holder: str, ttl_s: float) -> bool:
        """Extend the lease by ttl_s from now; False when `holder` no longer has it."""

    async def release_lease(self, holder: str) -> None: ...

    async def load_cursor(self) -> str | None:
        """Where the unfinished pass stopped (opaque to the store), None when no pass is under way."""

    async def save_cursor(self, cursor: str | None) -> None: ...

    async def add_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str], seen_at: float) -> None:
        """Note faces seen inconsistent; a face already noted keeps the time it was first seen."""

    async def due_suspects(
        self, kind: str, tenant_id: str, seen_before: float, offset: int, limit: int
    ) -> list[str]:
        """Up to `limit` noted faces first seen before `seen_before`, oldest first, skipping `offset`."""

    async def drop_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str]) -> None: ...

    async def count_suspects(self, kind: str, tenant_id: str) -> int: ...

    async def complete_pass(self, at: float) -> None:
        """Record that a pass completed at `at` and clear its cursor."""

    async def last_completed(self) -> float | None: ...


class BlobStore(Protocol):
    async def put(self, key: str, data: bytes, content_type: str) -> None: ...

    async def get(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, content_type), or None when absent."""

    async def delete(self, key: str) -> None: ...

    async def sweep(self, keep: Collection[str], older_than_s: float) -> int:
        """Delete every blob not named in `keep` and last written more than older_than_s ago; returns
        how many were deleted."""


class AuditLog(Protocol):
    async def append(self, tenant_id: str, entry: AuditEntry) -> None: ...

    async def page(
        self, tenant_id: str, before: str | None, limit: int
    ) -> tuple[list[AuditEntry], str | None]:
        """Up to `limit` entries, newest first, older than the cursor `before`; and the next cursor (None at
        the end). A cursor this method did not return raises ValueError."""


@dataclass(frozen=True)
class ClientInfo:
    client_id: str
    name: str
    created_at: float
    revoked: bool
    # Per-tenant face-search overrides; None: the service default (calibrated for the gallery size).
    min_score: float | None = None
    max_matches: int | None = None


class ClientStore(Protocol):
    async def create(self, name: str) -> tuple[ClientInfo, str]:
        """New client; returns its info and the plaintext secret (shown once, stored hashed)."""

    async def verify(self, client_id: str, secret: str) -> ClientInfo | None:
        """The client if the secret matches and it is not revoked, else None (constant-time compare)."""

    async def find_by_secret(self, secret: str) -> ClientInfo | None:
        """For the Client-Secret header: look the client up by a keyed hash of the secret."""

    async def get(self, client_id: str) -> ClientInfo | None: ...

    async def list(self) -> list[ClientInfo]: ...

    async def revoke(self, client_id: str) -> bool: ...

    async def update_search_settings(
        self, client_id: str, min_score: float | None, max_matches: int | None
    ) -> ClientInfo | None:
        """Set (a value) or clear (None) the tenant's overrides; None when the client is unknown."""


@dataclass(frozen=True)
class Admission:
    active: bool  # the client exists and is not revoked; nothing was counted otherwise
    retry_after_s: int = 0  # 0: within the client's allowance, else seconds until its window ends


def request_counter_key(client_id: str) -> str:
    """The RateLimiter key under which a client's requests are counted (by RequestAdmission.admit too)."""
    return f"requests:{client_id}"


class RequestAdmission(Protocol):
    async def admit(self, client_id: str, limit: int, window_s: int) -> Admission:
        """In one step (one round trip): whether client_id names an active client, and if it does, count one
        request against its allowance of `limit` per `window_s` (the counter RateLimiter.hit would use for
        the key `requests:<client_id>`)."""


class RateLimiter(Protocol):
    async def hit(self, key: str, limit: int, window_s: int) -> int:
        """Count one event for key; return 0 when allowed, else seconds until the window frees up."""

    async def peek(self, key: str, limit: int, window_s: int) -> int:
        """Like hit, without counting: 0 while under the limit, else seconds until the window frees up."""

    async def attempt(
        self, key: str, free_attempts: int, base_s: float, max_s: float, memory_s: float
    ) -> int:
        """Atomically: 0 and count the attempt, unless the key is backing off: then the seconds to wait.
        After free_attempts attempts the wait before the next one is base_s, doubling up to max_s."""

    async def reset(self, key: str) -> None: ...

"""The store interfaces the pipelines and API depend on. Implementations: redis_*.py, milvus_gallery.py,
blobs.py. Unit tests of the logic above may fake these; integration tests use the real servers.

Every method that talks to a backend raises serve_app.domain.errors.BackendUnavailable when the backend
cannot be reached, so callers never see redis/pymilvus exception types.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from serve_app.domain.faces import FaceRecord, GalleryEntry, GalleryMatch
from serve_app.domain.gallery import AuditEntry, GalleryCounts
from serve_app.domain.idempotency import IdempotencyClaim
from serve_app.domain.outcomes import Outcome
from serve_app.domain.transactions import Transaction
from serve_app.domain.webhooks import ClaimedEvent, DeliveryAttempt, QueueStats, Settlement, WebhookConfig


@dataclass(frozen=True)
class QueueEntry:
    entry_id: str  # stream entry id, needed to acknowledge
    reference_id: str
    deliveries: int  # how many times this entry has been handed to a consumer


class TransactionStore(Protocol):
    async def create_and_enqueue(self, tx: Transaction, claim: IdempotencyClaim | None = None) -> str:
        """Persist the transaction and put it on the work queue atomically; the reference_id the caller
        is given. With a claim, atomically too: when its key was recorded before, nothing is created and
        the recorded transaction's reference_id is returned (same fingerprint) or IdempotencyConflict
        raised (another); else the key is recorded with tx."""

    async def get(self, reference_id: str) -> Transaction | None:
        """The transaction, or None when unknown (any value that is not an issued reference id is)."""

    async def mark_processing(self, reference_id: str) -> Transaction | None:
        """Move QUEUED/PROCESSING → PROCESSING, bump attempts; None if unknown or already final."""

    async def complete(self, reference_id: str, result: Outcome) -> bool:
        """True when this call made the transaction final; False when it was final already (a final state
        is never overwritten) or is unknown."""

    async def fail(self, reference_id: str, error: str) -> None: ...

    async def wait_final(
        self, reference_id: str, timeout_s: float, *, seen_pending: bool = False
    ) -> Transaction | None:
        """Return the transaction once final, or its latest state when timeout_s passes. seen_pending: the
        caller has just read it, not final, so the store need not read it again before waiting."""

    async def count_by_state(self) -> dict[str, int]:
        """TransactionState value -> how many transactions are in that state; every state is present (0
        when none)."""

    async def image_keys_in_flight(self) -> set[str]:
        """Blob keys of the uploads of transactions not yet acknowledged on the work queue."""


@dataclass(frozen=True)
class FinishedEntry:
    entry_id: str  # position in the store's list of finished transactions
    reference_id: str
    transaction: Transaction | None  # None: it expired from the store meanwhile


class FinishedTransactions(Protocol):
    """The hot store's side of the result archive (pipelines/result_archive.py)."""

    async def finished_before(self, age_s: float, limit: int) -> list[FinishedEntry]:
        """Up to `limit` transactions that became final more than age_s ago, oldest first."""

    async def drop_archived(self, entries: Sequence[FinishedEntry]) -> int:
        """Delete the store's copies of these (final, archived) transactions and their list entries."""


class WorkQueue(Protocol):
    async def claim(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        """Up to `count` new entries for this consumer, oldest first, each handed to one consumer only
        (consumer group semantics); waits up to block_ms for one when there is none. count < 1 raises
        BackendUnavailable (Redis refuses COUNT 0), in reclaim_stale too."""

    async def reclaim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[QueueEntry]:
        """Up to `count` entries delivered to a consumer that has not acknowledged them for min_idle_ms (it
        died), oldest first, now this consumer's; their delivery count grows by one."""

    async def renew(self, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        """Renew this consumer's lease on entries it is still working on: their idle time restarts, their
        delivery count does not grow. Returns the ids it still holds; one another consumer reclaimed
        meanwhile is left to that consumer."""

    async def prune_consumers(self, consumer: str, gone_after_ms: int) -> list[str]:
        """Keep the consumer group to the workers that are alive, so it does not grow with every restart.
        Records that `consumer` (the caller) is alive, then removes every other consumer that is gone: it
        holds no pending entry, and for gone_after_ms it has neither been handed an entry nor called this
        method. A dead consumer's entries are first moved to a live one by reclaim_stale; until then it is
        kept (they would be lost with it). Live workers call this well within gone_after_ms, so a live one
        is never removed, whether it is idle or busy with one long entry. Returns the names removed."""

    async def ack(self, entry_ids: Sequence[str]) -> None: ...

    async def requeue(self, entry: QueueEntry) -> None:
        """Put the transaction back as a new, never-delivered entry (behind those already waiting) and drop
        the old one, atomically: used when a backend outage (not the transaction) made an attempt fail, so
        outages never count towards the poison-message limit. An entry no longer pending (acknowledged
        meanwhile: its transaction is done) is left alone, nothing is put back."""

    async def depth(self) -> int:
        """Entries not yet acknowledged (pending + undelivered)."""


@dataclass(frozen=True)
class LockPolicy:
    """How a face's lock (FaceRecordStore.reference_lock) is taken and kept. Defaults: Settings.redis."""

    wait_s: float  # waiting for the lock gives up after this (LockUnavailable)
    ttl_s: float  # a holder that stops renewing (it died, or is paused) loses the lock after this
    max_hold_s: float  # renewal stops after this: a holder stuck while alive cannot keep it for ever


class HeldLock(Protocol):
    """A face's lock while its holder has it. The holder renews it in the background; writes that name
    it (FaceRecordStore.put/delete/mark_erased with `lock`) are refused atomically once another holder
    has it, however long this holder was paused."""

    def check(self) -> None:
        """Raise LockUnavailable when this holder can no longer count on the lock: a renewal found it
        taken, or the time since the last successful renewal reached its ttl (the holder was paused).
        Called before writes to stores that cannot check the lock themselves (Milvus)."""


class FaceRecordStore(Protocol):
    async def put(self, record: FaceRecord, lock: HeldLock | None = None) -> None:
        """Store the record, or replace the one with its (tenant, face_id). A face's client_reference never
        changes (a replacement, as reindexing writes, keeps it): the Redis store's reference indexes are not
        rewritten, and counts() would go on counting the old reference. With `lock` (one this store's
        reference_lock gave), written only while that lock is still this holder's, checked atomically
        with the write; LockUnavailable otherwise, with nothing written."""

    async def get(self, tenant_id: str, face_id: str) -> FaceRecord | None: ...

    async def get_many(self, tenant_id: str, face_ids: Sequence[str]) -> dict[str, FaceRecord]: ...

    async def latest_for_reference(self, tenant_id: str, client_reference: str) -> FaceRecord | None:
        """The tenant's record of this client_reference with the newest created_at (of equal ones, the
        greatest face_id); None when the reference has no face."""

    async def delete(self, tenant_id: str, face_id: str, lock: HeldLock | None = None) -> None:
        """Remove the record and its index entries (none: a no-op); `lock` as for put."""

    async def existing(self, faces: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of these (tenant_id, face_id) have a record (one round trip, whatever their tenants)."""

    async def count(self, tenant_id: str) -> int:
        """How many faces the tenant has enrolled (one set cardinality: cheap)."""

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        """(tenant_id, face_id) of every record (the whole set in memory: small galleries and tests)."""

    async def tenant_ids(self) -> list[str]:
        """Every tenant that has ever had a face record, sorted."""

    def reference_lock(
        self, tenant_id: str, client_reference: str, policy: LockPolicy
    ) -> AbstractAsyncContextManager[HeldLock]:
        """Async context manager: a distributed lock serialising enrolments, overrides and erasures of one
        client_reference (or FaceRecord.lock_subject). Waiting longer than policy.wait_s raises
        LockUnavailable. The holder renews it every ttl_s / 3 while it works, for at most max_hold_s; one
        that stops (it died or was paused) loses it ttl_s after its last renewal, and its fenced writes
        are refused from the moment another holder has it. Only pipelines/lifecycle.py takes it."""

    async def page(
        self, tenant_id: str, after: str | None, limit: int
    ) -> tuple[list[FaceRecord], str | None]:
        """Up to `limit` of the tenant's records in face_id order, starting after the face id `after`, and
        the cursor (a face id) to continue from, None at the end. The order is by face id, so faces
        enrolled or deleted meanwhile never make a page repeat or skip a face that stays."""

    async def records_for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        """Every record of the tenant enrolled under this client_reference, in face_id order."""

    async def counts(self, tenant_id: str) -> GalleryCounts: ...

    async def mark_erased(
        self, tenant_id: str, client_reference: str, erased_at: float, lock: HeldLock | None = None
    ) -> None:
        """Remember (under a hash of the reference) when it was last erased: a transaction created before
        then must not enrol it again, and a result read later must not name it. `lock` as for put."""

    async def erased_at(self, tenant_id: str, client_reference: str) -> float | None:
        """When the reference was last erased; None if never (or longer ago than the store remembers)."""


class GalleryStore(Protocol):
    """Face vectors of one model version. A face_id names one entry across all tenants (the service derives
    it from a reference_id, unique everywhere). Ids are the service's own (letters, digits and _-.:@, 1-64
    characters) and vectors have the store's dimension with finite values; anything else raises
    ValueError before anything is written."""

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        """Upsert: an entry replaces the one with its face_id (whatever its tenant). An entry of another
        model version than the store's raises ValueError."""

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        """Most similar enrolled faces of this tenant and the store's model version only, best first, with
        cosine similarity >= min_similarity; at most `limit` (none when limit <= 0)."""

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None:
        """Remove these faces of this tenant from the gallery of every model version (the vectors an
        earlier version enrolled, which a re-index left in place, included): a deleted or erased face
        leaves no vector anywhere. Ids unknown or of another tenant are left alone."""

    async def page_ids(
        self, tenant_id: str, after: str | None, limit: int, *, all_versions: bool = False
    ) -> tuple[list[str], str | None]:
        """Up to `limit` of the tenant's face ids in face_id order, after the face id `after`, and the cursor
        to continue from (None at the end): a scan in bounded batches that can resume in another process.
        all_versions: the ids with a vector of any model version (each id once), not only of the store's."""

    async def present(
        self, tenant_id: str, face_ids: Sequence[str], *, all_versions: bool = False
    ) -> set[str]:
        """Which of these face ids have a vector (of the store's version, or with all_versions of any)."""


class TenantWriteClock(Protocol):
    """Per tenant, the Milvus timestamp of its newest acknowledged gallery write, shared by every replica:
    a search that waits for it sees that write (read-your-enrolment) without Strong's wait on every search
    (milvus_gallery, "Consistency")."""

    async def advance(self, tenant_id: str, timestamp: int) -> None:
        """Raise the tenant's timestamp to `timestamp`; a lower one leaves it as it is (monotone)."""

    async def read(self, tenant_id: str) -> int:
        """The tenant's timestamp; 0 when none was recorded."""


class Leases(Protocol):
    def try_hold(self, name: str, ttl_s: float) -> AbstractAsyncContextManager[bool]:
        """Async context manager: one attempt, without waiting, to take the cluster-wide lease `name` for
        at most ttl_s; yields whether it was taken, and gives it back on exit. A holder that dies loses it
        after ttl_s."""


class JobLease(Protocol):
    """The lease of a periodic job (pipelines/jobs.py), one holder at a time across the cluster, with the
    job's small state (a cursor, when a pass last completed) written only by the lease's holder."""

    async def acquire(self, holder: str, ttl_s: float) -> bool:
        """Take the lease if free, or renew it if `holder` has it; True when `holder` holds it now. A
        holder that stops renewing loses it after ttl_s."""

    async def renew(self, holder: str, ttl_s: float) -> bool:
        """Extend the lease by ttl_s from now; False when `holder` no longer has it."""

    async def release(self, holder: str) -> None:
        """Give it back if `holder` still has it (a lapsed holder never cuts another's lease short)."""

    async def read(self, field: str) -> str | None:
        """A state field of the job (None: never written, or deleted)."""

    async def write(self, holder: str, values: dict[str, str | None]) -> bool:
        """Set (a str) or delete (None) these state fields, only while `holder` has the lease, checked
        atomically with the writes; False (nothing written) when it has not."""


class ReconcileState(JobLease, Protocol):
    """Reconciliation's own state, shared by every process that may run it (pipelines/reconcile.py): the
    job's lease and fields (its resumable cursor, when the last pass completed) and the faces seen
    inconsistent and when first."""

    async def add_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str], seen_at: float) -> None:
        """Note faces seen inconsistent; a face already noted keeps the time it was first seen."""

    async def due_suspects(
        self, kind: str, tenant_id: str, seen_before: float, offset: int, limit: int
    ) -> list[str]:
        """Up to `limit` noted faces first seen before `seen_before`, oldest first, skipping `offset`."""

    async def drop_suspects(self, kind: str, tenant_id: str, face_ids: Sequence[str]) -> None: ...

    async def count_suspects(self, kind: str, tenant_id: str) -> int: ...

    async def last_completed(self) -> float | None:
        """When the last pass completed (its `last-pass` field)."""


class BlobStore(Protocol):
    """Keys are 1-512 characters of letters, digits, "_", "-" and "/" (no leading, trailing or doubled "/");
    content types 1-255 printable ASCII characters. Any other key or content type raises ValueError."""

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        """Store (or replace) the blob under key."""

    async def get(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, content_type), or None when absent."""

    async def delete(self, key: str) -> None: ...

    async def sweep(self, keep: Collection[str], older_than_s: float) -> int:
        """Delete every blob not named in `keep` and last written more than older_than_s ago; returns
        how many were deleted. A name in `keep` that is not a valid key is ignored."""

    async def scan_old(self, after: str | None, older_than_s: float, limit: int) -> BlobPage:
        """A page of the blobs last written more than older_than_s ago, in the store's own order, starting
        after the cursor `after` (None: from the start): about `limit` keys, whatever the store's size."""


@dataclass(frozen=True)
class BlobPage:
    keys: list[str]
    unnamed: int  # old blobs whose key the store does not know (written before keys were recorded)
    after: str | None  # the cursor to continue from; None at the end


class ResultArchive(Protocol):
    """Durable copies of finished transactions, read where the hot store no longer has them."""

    async def put(self, tx: Transaction) -> None: ...

    async def get(self, reference_id: str) -> Transaction | None:
        """None when there is no copy or the transaction's retention has passed."""

    async def sweep(self, archived_after_s: float) -> int:
        """Delete the copies past their retention (each was written archived_after_s or later after its
        transaction became final); returns how many went."""


class AuditLog(Protocol):
    async def append(self, tenant_id: str, entry: AuditEntry) -> None: ...

    async def page(
        self, tenant_id: str, before: str | None, limit: int
    ) -> tuple[list[AuditEntry], str | None]:
        """Up to `limit` entries, newest first, older than the cursor `before`; and the next cursor (None at
        the end). A value that is not of the form of the cursors this method returns raises ValueError."""


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
        """The client if the secret matches and it is not revoked, else None (constant-time compare); any
        str is accepted as a secret, one that is not valid Unicode too."""

    async def find_by_secret(self, secret: str) -> ClientInfo | None:
        """For the Client-Secret header: look the client up by a keyed hash of the secret; None when no
        active client has it."""

    async def get(self, client_id: str) -> ClientInfo | None: ...

    async def list(self) -> list[ClientInfo]:
        """Every client, revoked ones too, oldest first."""

    async def revoke(self, client_id: str) -> bool:
        """Mark the client revoked (its secret no longer verifies); False when it is unknown."""

    async def update_search_settings(
        self, client_id: str, min_score: float | None, max_matches: int | None
    ) -> ClientInfo | None:
        """Set (a value) or clear (None) the tenant's overrides; None when the client is unknown."""

    async def default_min_score(self) -> float | None:
        """The service-wide minimum match score set on the running service (`facesearch calibrate --apply
        default`, `facesearch clients update default`); None when none is set. A tenant's own comes first;
        it comes before FACESEARCH_MATCH_MIN_SCORE and the gallery-size default."""

    async def set_default_min_score(self, min_score: float | None) -> None:
        """Set (a value) or clear (None) the service-wide minimum match score."""


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

    async def attempt(
        self, key: str, free_attempts: int, base_s: float, max_s: float, memory_s: float
    ) -> int:
        """Atomically: 0 and count the attempt, unless the key is backing off: then the seconds to wait.
        After free_attempts attempts (fewer than 1 count as 1) the wait before the next one is base_s,
        doubling per attempt up to max_s. reset, or memory_s after the last wait ends without an attempt,
        forgets them."""

    async def reset(self, key: str) -> None: ...


class WebhookStore(Protocol):
    """A tenant's completion webhook: its endpoint, its signing secrets (sealed at rest), the durable queue
    of its completion events and its delivery log (pipelines/webhooks.py).

    Events are not put here by a method: the transaction store's final write (TransactionStore.complete
    and fail, when they make the transaction final) queues the transaction's event in the same atomic
    step when the tenant has an endpoint, due at once, so a final transaction never lacks its event.
    An event's id is domain.webhooks.event_id of its reference id; it is kept while queued and
    event_retention_s after it was delivered or marked dead."""

    async def get(self, tenant: str) -> WebhookConfig | None:
        """What may be shown of the tenant's webhook (never a secret); None when none was registered."""

    async def set_url(self, tenant: str, url: str) -> str | None:
        """Register the endpoint (the URL already vetted). Returns the signing secret when this created it
        (the first registration): the one time it is shown; None when the tenant had one already."""

    async def remove_url(self, tenant: str) -> bool:
        """No endpoint: nothing more is queued; the secret and events already queued stay (those are
        marked dead at their next attempt). False when there was no endpoint."""

    async def delete(self, tenant: str) -> bool:
        """Forget the endpoint, its secrets and the delivery log; False when there was nothing."""

    async def rotate_secret(self, tenant: str, grace_s: float) -> str:
        """A new signing secret, returned once. The previous one keeps signing beside it for grace_s (0:
        not at all), so receivers can switch without dropping events (Standard Webhooks' several
        signatures)."""

    async def signing_keys(self, tenant: str) -> tuple[str | None, list[bytes]]:
        """The endpoint (None: none) and the HMAC keys to sign with: the current secret's first, then the
        rotated-out one's while its grace lasts. SecretUnreadable when a stored secret cannot be opened."""

    async def claim_due(self, now: float, lease_s: float, count: int) -> list[ClaimedEvent]:
        """Up to `count` events due at `now` (oldest due first), each now this caller's: its attempt count
        grows by one and it is due again lease_s later, so the event of a caller that died is claimed
        again then."""

    async def settle(
        self, event: ClaimedEvent, outcome: Settlement, record: DeliveryAttempt, next_due: float | None = None
    ) -> bool:
        """Record a claimed attempt: RETRY (due again at next_due), DELIVERED or DEAD (both leave the
        queue). The attempt is added to the tenant's delivery log whatever happens; the event changes,
        and the totals count it, only while no later claim holds it (False: this attempt outlived its
        lease)."""

    async def redeliver(self, tenant: str, event_id: str) -> bool | None:
        """Queue a delivered or dead event of the tenant again, due now, with a fresh delivery window (its
        `since` is now). None: no such event of this tenant; False: it is queued already."""

    async def event_state(self, event_id: str) -> dict[str, str]:
        """The event's fields, among them `state` (pending, delivering, delivered, dead) and `attempts`;
        {} when unknown."""

    async def deliveries(self, tenant: str, limit: int) -> list[DeliveryAttempt]:
        """The tenant's last `limit` attempts, newest first (the log keeps the last log_size)."""

    async def stats(self, now: float) -> QueueStats:
        """Events not yet delivered or dead, the age at `now` of the oldest of them, and the settled
        attempts' totals by outcome (every outcome present)."""

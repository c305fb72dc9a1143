"""In-memory fakes behind the store interfaces of serve_app/stores/interfaces.py, for unit tests only.

They honour the Protocol semantics the pipelines rely on:
- transactions: a final state is never overwritten; mark_processing refuses unknown and final ones;
- work queue: consumer-group semantics: claim hands out undelivered entries, an entry stays pending until
  acknowledged, reclaim_stale hands pending entries idle for min_idle_ms to another consumer and bumps their
  delivery count; asking for zero entries is refused as Redis refuses COUNT 0;
- gallery: search is filtered by tenant and min_similarity (inner product of unit vectors) and sorted by
  similarity, best first;
- records: reference_lock is a real mutual-exclusion lock per (tenant, client_reference); the latest face of
  a reference is the one with the newest created_at;
- rate limiter: fixed windows counting every hit, like the Redis limiter.

Every fake yields to the event loop on each call (as a network store would), so concurrent callers really
interleave, and can be told to fail (`Faults`) to simulate a backend outage or a crash between two steps.
Keys and values are encoded as UTF-8 like a byte-keyed store (Redis) does, so a string that cannot be stored
fails here as it would there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hashlib
import hmac
import io
import itertools
import math
import struct
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from PIL import Image

from models.calibration import FaceScoreCalibration
from models.types import AgeEstimate, AnalyzedFace, DetectedFace, FaceQuality
from serve_app.api.app import ApiServices, create_app
from serve_app.api.limits import parse_networks
from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.faces import FaceRecord, GalleryEntry, GalleryMatch
from serve_app.domain.gallery import AuditEntry, GalleryCounts
from serve_app.domain.identifiers import new_client_id, new_client_secret
from serve_app.domain.outcomes import Outcome
from serve_app.domain.transactions import Transaction, TransactionState
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.stores.interfaces import Admission, ClientInfo, QueueEntry, request_counter_key
from serve_app.stores.outcome_codec import decode_outcome, encode_outcome

EMBEDDING_SIZE = 256  # face model v2 (models.embedder.FUSED_DIM)


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Faults:
    """Armed failures, by operation name ("transactions.complete", "gallery.delete", ...)."""

    def __init__(self) -> None:
        self._armed: dict[str, list[BaseException]] = {}
        self.calls: dict[str, int] = {}

    def arm(self, operation: str, times: int = 1, error: BaseException | None = None) -> None:
        failure = error if error is not None else BackendUnavailable(f"{operation} is unavailable")
        self._armed.setdefault(operation, []).extend([failure] * times)

    async def check(self, operation: str) -> None:
        self.calls[operation] = self.calls.get(operation, 0) + 1
        await asyncio.sleep(0)  # a real store round-trips; let other tasks run
        pending = self._armed.get(operation)
        if pending:
            raise pending.pop(0)


def _encodable(*values: str | None) -> None:
    for value in values:
        if value is not None:
            value.encode("utf-8")  # UnicodeEncodeError for lone surrogates, as redis-py would raise


# --------------------------------------------------------------------------------------------- queue


@dataclass
class _Pending:
    reference_id: str
    consumer: str
    deliveries: int
    delivered_at: float


class FakeWorkQueue:
    """A Redis stream with one consumer group."""

    def __init__(self, faults: Faults | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._faults = faults or Faults()
        self._clock = clock
        self._ids = itertools.count(1)
        self._undelivered: deque[tuple[str, str]] = deque()
        self._pending: dict[str, _Pending] = {}
        self.acked: list[str] = []
        self.deliveries: list[QueueEntry] = []  # every hand-out, in order
        self.requeued: list[str] = []  # reference ids put back after a backend outage
        self.renewals: list[str] = []  # entry ids whose lease was renewed

    def add(self, reference_id: str) -> str:
        entry_id = f"{next(self._ids)}-0"
        self._undelivered.append((entry_id, reference_id))
        return entry_id

    async def claim(self, consumer: str, count: int, block_ms: int) -> list[QueueEntry]:
        await self._faults.check("queue.claim")
        _positive_count(count)
        deadline = asyncio.get_running_loop().time() + block_ms / 1000
        # Polls like XREADGROUP BLOCK waits: entries arrive from sync add() calls, with no event to await.
        while not self._undelivered and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
        entries: list[QueueEntry] = []
        while self._undelivered and len(entries) < count:
            entry_id, reference_id = self._undelivered.popleft()
            self._pending[entry_id] = _Pending(reference_id, consumer, 1, self._clock())
            entries.append(QueueEntry(entry_id, reference_id, 1))
        self.deliveries.extend(entries)
        return entries

    async def reclaim_stale(self, consumer: str, min_idle_ms: int, count: int) -> list[QueueEntry]:
        await self._faults.check("queue.reclaim_stale")
        _positive_count(count)
        now = self._clock()
        entries: list[QueueEntry] = []
        for entry_id, pending in sorted(self._pending.items(), key=lambda item: _id_order(item[0])):
            if len(entries) >= count:
                break
            if (now - pending.delivered_at) * 1000 >= min_idle_ms:
                pending.consumer = consumer
                pending.deliveries += 1
                pending.delivered_at = now
                entries.append(QueueEntry(entry_id, pending.reference_id, pending.deliveries))
        self.deliveries.extend(entries)
        return entries

    async def renew(self, consumer: str, entry_ids: Sequence[str]) -> list[str]:
        await self._faults.check("queue.renew")
        held = []
        for entry_id in entry_ids:
            pending = self._pending.get(entry_id)
            if pending is not None and pending.consumer == consumer:
                pending.delivered_at = self._clock()
                held.append(entry_id)
        self.renewals.extend(held)
        return held

    async def requeue(self, entry: QueueEntry) -> None:
        await self._faults.check("queue.requeue")
        if self._pending.pop(entry.entry_id, None) is not None:
            self._undelivered.append((f"{next(self._ids)}-0", entry.reference_id))
            self.requeued.append(entry.reference_id)

    async def ack(self, entry_ids: Sequence[str]) -> None:
        await self._faults.check("queue.ack")
        for entry_id in entry_ids:
            if self._pending.pop(entry_id, None) is not None:
                self.acked.append(entry_id)

    async def depth(self) -> int:
        await self._faults.check("queue.depth")
        return len(self._undelivered) + len(self._pending)

    @property
    def pending(self) -> dict[str, int]:
        """entry_id -> delivery count of entries delivered and not acknowledged."""
        return {entry_id: pending.deliveries for entry_id, pending in self._pending.items()}

    def reference_ids(self) -> set[str]:
        """Reference ids of every entry not yet acknowledged."""
        return {ref for _entry_id, ref in self._undelivered} | {
            p.reference_id for p in self._pending.values()
        }

    @property
    def undelivered(self) -> int:
        return len(self._undelivered)


def _positive_count(count: int) -> None:
    """Redis refuses XREADGROUP/XAUTOCLAIM with COUNT 0 ("ERR COUNT must be > 0"); the store reports it as
    BackendUnavailable, so the fake does too."""
    if count < 1:
        raise BackendUnavailable(f"ERR COUNT must be > 0 (got {count})")


def _id_order(entry_id: str) -> tuple[int, int]:
    first, _, second = entry_id.partition("-")
    return int(first), int(second or 0)


# ---------------------------------------------------------------------------------------- transactions


class FakeTransactionStore:
    """Transactions by reference id; create_and_enqueue also adds the entry to `queue`."""

    def __init__(
        self,
        queue: FakeWorkQueue | None = None,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.queue = queue if queue is not None else FakeWorkQueue(faults)
        self._faults = faults or Faults()
        self._clock = clock
        # (reference_id, timeout asked for, whether it ended on a final state) per wait_final call: what a
        # test checks instead of the wall clock.
        self.waits: list[tuple[str, float, bool]] = []
        self._items: dict[str, Transaction] = {}
        self.entry_of: dict[str, str] = {}  # reference_id -> stream entry id

    async def create_and_enqueue(self, tx: Transaction) -> None:
        await self._faults.check("transactions.create_and_enqueue")
        _encodable(tx.reference_id, tx.tenant_id, tx.client_reference, tx.image_key)
        self._items[tx.reference_id] = copy.deepcopy(tx)
        self.entry_of[tx.reference_id] = self.queue.add(tx.reference_id)

    async def image_keys_in_flight(self) -> set[str]:
        await self._faults.check("transactions.image_keys_in_flight")
        queued = self.queue.reference_ids()
        return {self._items[ref].image_key for ref in queued if ref in self._items}

    async def get(self, reference_id: str) -> Transaction | None:
        await self._faults.check("transactions.get")
        _encodable(reference_id)
        tx = self._items.get(reference_id)
        return copy.deepcopy(tx) if tx is not None else None

    async def mark_processing(self, reference_id: str) -> Transaction | None:
        await self._faults.check("transactions.mark_processing")
        tx = self._items.get(reference_id)
        if tx is None or tx.state.is_final:
            return None
        tx.state = TransactionState.PROCESSING
        tx.attempts += 1
        tx.updated_at = self._clock()
        return copy.deepcopy(tx)

    async def complete(self, reference_id: str, result: Outcome) -> None:
        await self._faults.check("transactions.complete")
        tx = self._items.get(reference_id)
        # Through the stores' one JSON form, as Redis would keep it.
        stored = decode_outcome(tx.kind, encode_outcome(result)) if tx is not None else result
        self._finalise(reference_id, TransactionState.COMPLETED, result=stored)

    async def fail(self, reference_id: str, error: str) -> None:
        await self._faults.check("transactions.fail")
        self._finalise(reference_id, TransactionState.FAILED, error=error)

    def _finalise(
        self, reference_id: str, state: TransactionState, result: Any = None, error: str | None = None
    ) -> None:
        tx = self._items.get(reference_id)
        if tx is None or tx.state.is_final:
            return  # a final state is never overwritten
        tx.state = state
        tx.result = result
        tx.error = error
        tx.updated_at = self._clock()

    async def wait_final(
        self, reference_id: str, timeout_s: float, *, seen_pending: bool = False
    ) -> Transaction | None:
        await self._faults.check("transactions.wait_final")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            tx = self._items.get(reference_id)
            if tx is None or tx.state.is_final or loop.time() >= deadline:
                self.waits.append((reference_id, timeout_s, tx is not None and tx.state.is_final))
                return copy.deepcopy(tx) if tx is not None else None
            await asyncio.sleep(0.005)

    async def count_by_state(self) -> dict[str, int]:
        await self._faults.check("transactions.count_by_state")
        counts: dict[str, int] = {}
        for tx in self._items.values():
            counts[tx.state.value] = counts.get(tx.state.value, 0) + 1
        return counts

    # Test helpers (not part of the Protocol).
    def peek(self, reference_id: str) -> Transaction:
        return copy.deepcopy(self._items[reference_id])

    def force(self, tx: Transaction) -> None:
        self._items[tx.reference_id] = copy.deepcopy(tx)


# ------------------------------------------------------------------------------------------ records


class FakeFaceRecordStore:
    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self._items: dict[tuple[str, str], FaceRecord] = {}
        self._order = itertools.count()
        self._put_order: dict[tuple[str, str], int] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.lock_holders: dict[tuple[str, str], int] = {}
        self.max_lock_holders = 0
        self.lock_acquisitions: list[tuple[str, str]] = []
        self._tenants: set[str] = set()  # as in Redis: a tenant stays listed after its last face goes

    async def put(self, record: FaceRecord) -> None:
        await self._faults.check("records.put")
        _encodable(record.tenant_id, record.face_id, record.client_reference, record.proof_key)
        self._tenants.add(record.tenant_id)
        key = (record.tenant_id, record.face_id)
        if key not in self._items:
            self._put_order[key] = next(self._order)
        self._items[key] = record

    async def count(self, tenant_id: str) -> int:
        await self._faults.check("records.count")
        return sum(1 for tenant, _ in self._items if tenant == tenant_id)

    async def get(self, tenant_id: str, face_id: str) -> FaceRecord | None:
        await self._faults.check("records.get")
        _encodable(tenant_id, face_id)
        return self._items.get((tenant_id, face_id))

    async def get_many(self, tenant_id: str, face_ids: Sequence[str]) -> dict[str, FaceRecord]:
        await self._faults.check("records.get_many")
        return {
            face_id: self._items[(tenant_id, face_id)]
            for face_id in face_ids
            if (tenant_id, face_id) in self._items
        }

    async def latest_for_reference(self, tenant_id: str, client_reference: str) -> FaceRecord | None:
        await self._faults.check("records.latest_for_reference")
        candidates = [
            (record.created_at, self._put_order[key], record)
            for key, record in self._items.items()
            if record.tenant_id == tenant_id and record.client_reference == client_reference
        ]
        return max(candidates, key=lambda item: item[:2])[2] if candidates else None

    async def delete(self, tenant_id: str, face_id: str) -> None:
        await self._faults.check("records.delete")
        self._items.pop((tenant_id, face_id), None)
        self._put_order.pop((tenant_id, face_id), None)

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        await self._faults.check("records.all_face_ids")
        return {key for key in self._items if tenant_id is None or key[0] == tenant_id}

    async def tenant_ids(self) -> list[str]:
        await self._faults.check("records.tenant_ids")
        return sorted(self._tenants)

    def reference_lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> Any:
        return self._lock(tenant_id, client_reference, timeout_s)

    @contextlib.asynccontextmanager
    async def _lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> AsyncIterator[None]:
        key = (tenant_id, client_reference)
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), timeout_s)
        except TimeoutError:
            raise BackendUnavailable(f"lock on {client_reference!r} not acquired in {timeout_s}s") from None
        self.lock_acquisitions.append(key)
        self.lock_holders[key] = self.lock_holders.get(key, 0) + 1
        self.max_lock_holders = max(self.max_lock_holders, self.lock_holders[key])
        try:
            yield
        finally:
            self.lock_holders[key] -= 1
            lock.release()

    async def page(
        self, tenant_id: str, after: str | None, limit: int
    ) -> tuple[list[FaceRecord], str | None]:
        await self._faults.check("records.page")
        ordered = sorted(face_id for tenant, face_id in self._items if tenant == tenant_id)
        chosen = [face_id for face_id in ordered if after is None or face_id > after][:limit]
        next_cursor = chosen[-1] if len(chosen) == limit else None
        return [self._items[(tenant_id, face_id)] for face_id in chosen], next_cursor

    async def records_for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        await self._faults.check("records.records_for_reference")
        return sorted(self.for_reference(tenant_id, client_reference), key=lambda record: record.face_id)

    async def counts(self, tenant_id: str) -> GalleryCounts:
        await self._faults.check("records.counts")
        records = self.records(tenant_id)
        times = [record.created_at for record in records]
        return GalleryCounts(
            faces=len(records),
            client_references=len({r.client_reference for r in records if r.client_reference is not None}),
            oldest_enrolment=min(times) if times else None,
            newest_enrolment=max(times) if times else None,
        )

    # Test helpers.
    def records(self, tenant_id: str | None = None) -> list[FaceRecord]:
        return [record for key, record in self._items.items() if tenant_id is None or key[0] == tenant_id]

    def for_reference(self, tenant_id: str, client_reference: str) -> list[FaceRecord]:
        return [record for record in self.records(tenant_id) if record.client_reference == client_reference]


class NonExclusiveRecordStore(FakeFaceRecordStore):
    """A record store whose reference lock excludes nothing: shows what the lock protects against."""

    def reference_lock(self, tenant_id: str, client_reference: str, timeout_s: float) -> Any:
        return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------ gallery


class FakeGalleryStore:
    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self._items: dict[tuple[str, str], GalleryEntry] = {}
        self.searches: list[tuple[str, int, float]] = []  # (tenant_id, limit, min_similarity)

    async def add(self, entries: Sequence[GalleryEntry]) -> None:
        await self._faults.check("gallery.add")
        for entry in entries:
            embedding = np.asarray(entry.embedding, dtype=np.float32)
            assert embedding.shape == (EMBEDDING_SIZE,), embedding.shape
            self._items[(entry.tenant_id, entry.face_id)] = dataclasses.replace(entry, embedding=embedding)

    async def search(
        self, tenant_id: str, embedding: np.ndarray, limit: int, min_similarity: float
    ) -> list[GalleryMatch]:
        await self._faults.check("gallery.search")
        self.searches.append((tenant_id, limit, min_similarity))
        probe = np.asarray(embedding, dtype=np.float64)
        scored = []
        for (tenant, face_id), entry in self._items.items():
            if tenant != tenant_id:
                continue
            similarity = float(entry.embedding.astype(np.float64) @ probe)
            if similarity >= min_similarity:
                scored.append(GalleryMatch(face_id, similarity))
        scored.sort(key=lambda match: (-match.similarity, match.face_id))
        return scored[:limit]

    async def delete(self, tenant_id: str, face_ids: Sequence[str]) -> None:
        await self._faults.check("gallery.delete")
        for face_id in face_ids:
            self._items.pop((tenant_id, face_id), None)

    async def all_face_ids(self, tenant_id: str | None = None) -> set[tuple[str, str]]:
        await self._faults.check("gallery.all_face_ids")
        return {key for key in self._items if tenant_id is None or key[0] == tenant_id}

    async def page_ids(self, tenant_id: str, after: str | None, limit: int) -> tuple[list[str], str | None]:
        await self._faults.check("gallery.page_ids")
        chosen = sorted(f for t, f in self._items if t == tenant_id and (after is None or f > after))[:limit]
        return chosen, (chosen[-1] if len(chosen) == limit else None)

    async def present(self, tenant_id: str, face_ids: Sequence[str]) -> set[str]:
        await self._faults.check("gallery.present")
        return {face_id for face_id in face_ids if (tenant_id, face_id) in self._items}

    async def count(self) -> int:
        await self._faults.check("gallery.count")
        return len(self._items)

    # Test helpers.
    def face_ids(self, tenant_id: str | None = None) -> set[str]:
        return {face_id for tenant, face_id in self._items if tenant_id is None or tenant == tenant_id}

    def entry(self, tenant_id: str, face_id: str) -> GalleryEntry:
        return self._items[(tenant_id, face_id)]


# -------------------------------------------------------------------------------------------- audit


class FakeAuditLog:
    """Entries per tenant in append order; cursors are their positions, as stream ids are in Redis."""

    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self.entries: dict[str, list[AuditEntry]] = {}

    async def append(self, tenant_id: str, entry: AuditEntry) -> None:
        await self._faults.check("audit.append")
        self.entries.setdefault(tenant_id, []).append(entry)

    async def page(
        self, tenant_id: str, before: str | None, limit: int
    ) -> tuple[list[AuditEntry], str | None]:
        await self._faults.check("audit.page")
        if before is not None and not before.isdigit():
            raise ValueError("not an audit cursor")
        stored = self.entries.get(tenant_id, [])
        end = int(before) if before is not None else len(stored)
        positions = list(range(end - 1, -1, -1))[:limit]
        next_cursor = str(positions[-1]) if len(positions) == limit else None
        return [stored[position] for position in positions], next_cursor


# -------------------------------------------------------------------------------------------- blobs


class FakeBlobStore:
    def __init__(self, faults: Faults | None = None) -> None:
        self._faults = faults or Faults()
        self.items: dict[str, tuple[bytes, str]] = {}
        self.written_at: dict[str, float] = {}  # key -> time.time() of its last write

    async def put(self, key: str, data: bytes, content_type: str) -> None:
        await self._faults.check("blobs.put")
        _encodable(key)
        self.items[key] = (bytes(data), content_type)
        self.written_at[key] = time.time()

    async def get(self, key: str) -> tuple[bytes, str] | None:
        await self._faults.check("blobs.get")
        return self.items.get(key)

    async def delete(self, key: str) -> None:
        await self._faults.check("blobs.delete")
        self.items.pop(key, None)
        self.written_at.pop(key, None)

    async def sweep(self, keep: Collection[str], older_than_s: float) -> int:
        await self._faults.check("blobs.sweep")
        cutoff = time.time() - older_than_s
        doomed = [key for key in self.items if key not in keep and self.written_at.get(key, 0.0) < cutoff]
        for key in doomed:
            await self.delete(key)
        return len(doomed)


# ------------------------------------------------------------------------------- clients and limits


class FakeClientStore:
    """Secrets are kept only as keyed hashes, compared in constant time."""

    def __init__(self, pepper: bytes = b"unit-test-pepper") -> None:
        self._pepper = pepper
        self._clients: dict[str, ClientInfo] = {}
        self._hashes: dict[str, bytes] = {}  # client_id -> keyed hash of the secret

    def _hash(self, secret: str) -> bytes:
        return hmac.new(self._pepper, secret.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()

    async def create(self, name: str) -> tuple[ClientInfo, str]:
        await asyncio.sleep(0)
        client = ClientInfo(client_id=new_client_id(), name=name, created_at=time.time(), revoked=False)
        secret = new_client_secret()
        self._clients[client.client_id] = client
        self._hashes[client.client_id] = self._hash(secret)
        return client, secret

    async def verify(self, client_id: str, secret: str) -> ClientInfo | None:
        await asyncio.sleep(0)
        client = self._clients.get(client_id)
        expected = self._hashes.get(client_id, b"\0" * 32)
        matches = hmac.compare_digest(expected, self._hash(secret))
        if client is None or client.revoked or not matches:
            return None
        return client

    async def find_by_secret(self, secret: str) -> ClientInfo | None:
        await asyncio.sleep(0)
        digest = self._hash(secret)
        for client_id, stored in self._hashes.items():
            if hmac.compare_digest(stored, digest):
                client = self._clients[client_id]
                return None if client.revoked else client
        return None

    async def get(self, client_id: str) -> ClientInfo | None:
        await asyncio.sleep(0)
        return self._clients.get(client_id)

    async def list(self) -> list[ClientInfo]:
        await asyncio.sleep(0)
        return sorted(self._clients.values(), key=lambda client: client.created_at)

    async def revoke(self, client_id: str) -> bool:
        await asyncio.sleep(0)
        client = self._clients.get(client_id)
        if client is None:
            return False
        self._clients[client_id] = dataclasses.replace(client, revoked=True)
        return True

    async def update_search_settings(
        self, client_id: str, min_score: float | None, max_matches: int | None
    ) -> ClientInfo | None:
        await asyncio.sleep(0)
        client = self._clients.get(client_id)
        if client is None:
            return None
        updated = dataclasses.replace(client, min_score=min_score, max_matches=max_matches)
        self._clients[client_id] = updated
        return updated


class FakeRequestAdmission:
    """RequestAdmission over the fake client store and limiter: the same answers as the Redis script
    (nothing counted for an unknown or revoked client)."""

    def __init__(self, clients: FakeClientStore, limiter: FakeRateLimiter) -> None:
        self._clients = clients
        self._limiter = limiter
        self.calls = 0

    async def admit(self, client_id: str, limit: int, window_s: int) -> Admission:
        self.calls += 1
        client = await self._clients.get(client_id)
        if client is None or client.revoked:
            return Admission(active=False)
        return Admission(
            active=True,
            retry_after_s=await self._limiter.hit(request_counter_key(client_id), limit, window_s),
        )


class FakeRateLimiter:
    """Fixed windows, like the Redis limiter: a window opens at a key's first event and lasts window_s;
    every hit counts, refused ones too. The clock is the test's."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # key -> (window end, events counted)
        self._attempts: dict[str, tuple[int, float, float]] = {}  # key -> (count, blocked until, forget at)
        self.hits: list[str] = []

    def _current(self, key: str) -> tuple[float, int] | None:
        window = self._windows.get(key)
        if window is not None and window[0] <= self._clock():
            del self._windows[key]
            return None
        return window

    def _seconds_left(self, end: float) -> int:
        return max(1, math.ceil(end - self._clock()))

    async def hit(self, key: str, limit: int, window_s: int) -> int:
        await asyncio.sleep(0)
        self.hits.append(key)
        end, count = self._current(key) or (self._clock() + window_s, 0)
        self._windows[key] = (end, count + 1)
        return 0 if count + 1 <= limit else self._seconds_left(end)

    async def peek(self, key: str, limit: int, window_s: int) -> int:
        await asyncio.sleep(0)
        window = self._current(key)
        if window is None or window[1] < limit:
            return 0
        return self._seconds_left(window[0])

    async def attempt(
        self, key: str, free_attempts: int, base_s: float, max_s: float, memory_s: float
    ) -> int:
        # No await before the decision: like the Redis script, check and count are one step.
        now = self._clock()
        count, blocked_until, forget_at = self._attempts.get(key, (0, 0.0, 0.0))
        if forget_at <= now:
            count, blocked_until = 0, 0.0
        if blocked_until > now:
            await asyncio.sleep(0)
            return self._seconds_left(blocked_until)
        count += 1
        wait = min(base_s * 2 ** (count - free_attempts), max_s) if count >= free_attempts else 0.0
        self._attempts[key] = (count, now + wait, now + memory_s + wait)
        await asyncio.sleep(0)
        return 0

    async def reset(self, key: str) -> None:
        await asyncio.sleep(0)
        self._windows.pop(key, None)
        self._attempts.pop(key, None)


# ------------------------------------------------------------------------------------------ models


def embedding(seed: int) -> np.ndarray:
    """A unit vector like face model v2's; different seeds are nearly orthogonal (|cosine| < 0.3)."""
    vector = np.random.default_rng(seed).normal(size=EMBEDDING_SIZE)
    return (vector / np.linalg.norm(vector)).astype(np.float32)


def at_cosine(base: np.ndarray, cosine: float, seed: int = 0) -> np.ndarray:
    """A unit vector whose cosine with the unit vector base is `cosine` (up to float32 rounding)."""
    unit = base.astype(np.float64) / np.linalg.norm(base)
    direction = np.random.default_rng(10_000 + seed).normal(size=EMBEDDING_SIZE)
    direction -= (direction @ unit) * unit
    direction /= np.linalg.norm(direction)
    return (cosine * unit + math.sqrt(max(0.0, 1.0 - cosine * cosine)) * direction).astype(np.float32)


def age_estimate(age: int) -> AgeEstimate:
    under_18 = 100 if age < 16 else 50 if age < 20 else 0
    under_21 = 100 if age < 19 else 50 if age < 23 else 0
    return AgeEstimate(
        age=age,
        expected_age=float(age),
        p_under_18=under_18 / 100,
        p_under_21=under_21 / 100,
        under_18=under_18,
        under_21=under_21,
    )


def face(
    vector: np.ndarray | None = None,
    age: int | None = None,
    size: float = 100.0,
    quality: FaceQuality | None = None,
    x: float = 10.0,
) -> AnalyzedFace:
    detection = DetectedFace(
        box=np.array([x, 10.0, x + size, 10.0 + size], dtype=np.float32),
        landmarks=np.zeros((5, 2), dtype=np.float32),
        score=0.99,
    )
    return AnalyzedFace(
        detection=detection,
        embedding=vector,
        age=age_estimate(age) if age is not None else None,
        quality=quality,
    )


def quality(enrol_ok: bool = True, search_ok: bool = True, reasons: tuple[str, ...] = ()) -> FaceQuality:
    """A quality verdict as models.quality gives it (measurements of a plausible face)."""
    return FaceQuality(
        face_size_px=120.0,
        detector_score=0.95,
        sharpness=200.0,
        yaw=0.0,
        pitch=0.5,
        roll_deg=0.0,
        enrol_ok=enrol_ok,
        search_ok=search_ok,
        reasons=reasons,
    )


def face_quality(ok: bool = True) -> FaceQuality:
    """A verdict passing both bars, or failing both for blur."""
    return quality(enrol_ok=ok, search_ok=ok, reasons=() if ok else ("blurry",))


Color = tuple[int, int, int]


class ScriptedAnalysis:
    """A FaceAnalysisBackend whose answer depends on the colour of the image's top-left pixel.

    Tests upload solid-colour PNGs (lossless), so each transaction can be given its own faces.
    """

    def __init__(self, faces_by_color: dict[Color, list[AnalyzedFace]] | None = None) -> None:
        self.faces_by_color = dict(faces_by_color or {})
        self.calls: list[tuple[Color, bool, bool]] = []
        self.failures: list[BaseException] = []  # raised by the next calls, in order
        self.gate: asyncio.Event | None = None  # when set up, analyze waits for it
        self.started = 0

    async def analyze(self, image: np.ndarray, *, embed: bool, estimate_age: bool) -> list[AnalyzedFace]:
        self.started += 1
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        color: Color = (int(image[0, 0, 0]), int(image[0, 0, 1]), int(image[0, 0, 2]))
        self.calls.append((color, embed, estimate_age))
        await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            raise self.failures.pop(0)
        faces = self.faces_by_color.get(color, [])
        return [
            AnalyzedFace(
                detection=item.detection,
                embedding=item.embedding if embed else None,
                age=item.age if estimate_age else None,
                quality=item.quality,
            )
            for item in faces
        ]


# ------------------------------------------------------------------------------------------ images


def image_bytes(image: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def solid_png(color: Color, size: tuple[int, int] = (16, 16)) -> bytes:
    return image_bytes(Image.new("RGB", size, color), "PNG")


def uniform_png(width: int, height: int, bit_depth: int, color_type: int, row: bytes | None = None) -> bytes:
    """A PNG written by hand, every scanline the same: huge dimensions stay small on disk and in memory.

    color_type: 0 gray, 2 RGB, 3 palette (a two-colour PLTE is added), 4 gray+alpha, 6 RGBA.
    """
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    row_bytes = (width * channels * bit_depth + 7) // 8
    scanline = b"\x00" + (row if row is not None else bytes(row_bytes))
    assert len(scanline) == row_bytes + 1

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload))
            + kind
            + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)
        )

    compressor = zlib.compressobj(9)
    compressed = b"".join(compressor.compress(scanline) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    palette = chunk(b"PLTE", bytes([0, 0, 0, 255, 255, 255])) if color_type == 3 else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + palette
        + chunk(b"IDAT", compressed)
        + chunk(b"IEND", b"")
    )


def jpeg(size: tuple[int, int] = (32, 24), color: Color = (120, 90, 60)) -> bytes:
    return image_bytes(Image.new("RGB", size, color), "JPEG", quality=90)


# ------------------------------------------------------------------------------------------- world

TEST_POLICY = ProcessingPolicy(
    model_version="unit-test-v2",
    max_matches=10,
    min_score=0.5,  # fixed, so tests do not depend on gallery sizes unless they ask (min_score=None)
    max_image_pixels=40_000_000,
    analysis_max_side=1920,
    calibration=FaceScoreCalibration.load(),
    override_lock_timeout_s=5.0,
    tenant_cache_s=0.0,
)


@dataclass
class World:
    """Every fake store, wired together as the real ones are."""

    faults: Faults = field(default_factory=Faults)
    queue_clock: ManualClock | None = None
    records: FakeFaceRecordStore | None = None
    transactions: FakeTransactionStore = field(init=False)
    queue: FakeWorkQueue = field(init=False)
    gallery: FakeGalleryStore = field(init=False)
    blobs: FakeBlobStore = field(init=False)
    analysis: ScriptedAnalysis = field(default_factory=ScriptedAnalysis)
    policy: ProcessingPolicy = TEST_POLICY
    clients: FakeClientStore = field(default_factory=FakeClientStore)

    def __post_init__(self) -> None:
        clock: Callable[[], float] = self.queue_clock if self.queue_clock is not None else time.monotonic
        self.queue = FakeWorkQueue(self.faults, clock)
        self.transactions = FakeTransactionStore(self.queue, self.faults)
        if self.records is None:
            self.records = FakeFaceRecordStore(self.faults)
        self.gallery = FakeGalleryStore(self.faults)
        self.blobs = FakeBlobStore(self.faults)

    @property
    def record_store(self) -> FakeFaceRecordStore:
        assert self.records is not None
        return self.records

    def processor(self) -> TransactionProcessor:
        return TransactionProcessor(
            self.transactions,
            self.record_store,
            self.gallery,
            self.blobs,
            self.analysis,
            self.policy,
            clients=self.clients,
        )

    def transaction_service(self, max_image_pixels: int = 40_000_000) -> TransactionService:
        return TransactionService(self.transactions, self.blobs, max_image_pixels)

    async def enrol(
        self,
        tenant_id: str,
        face_id: str,
        vector: np.ndarray,
        client_reference: str | None = None,
        created_at: float | None = None,
        proof: bytes = b"proof-bytes",
    ) -> FaceRecord:
        """An enrolled face as a finished enrolment leaves it: record, vector and proof blob."""
        record = FaceRecord(
            face_id=face_id,
            tenant_id=tenant_id,
            client_reference=client_reference,
            proof_key=f"proofs/{tenant_id}/{face_id}",
            model_version=self.policy.model_version,
            created_at=created_at if created_at is not None else time.time() - 3600,
            reference_id=f"ref-{face_id}",
        )
        await self.blobs.put(record.proof_key, proof, "image/png")
        await self.record_store.put(record)
        await self.gallery.add(
            [
                GalleryEntry(
                    face_id=face_id,
                    tenant_id=tenant_id,
                    model_version=record.model_version,
                    embedding=vector,
                    created_at=record.created_at,
                )
            ]
        )
        return record


@dataclass
class Api:
    """The ASGI app over a World, with one registered client (the tenant of most tests)."""

    world: World
    signer: TokenSigner
    clients: FakeClientStore
    limiter: FakeRateLimiter
    auth: ClientAuthenticator
    services: ApiServices
    client_id: str
    client_secret: str

    def token(self, client_id: str | None = None) -> str:
        return self.signer.issue_access(client_id or self.client_id)[0]

    def headers(self, client_id: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(client_id)}"}

    def http(self, client: tuple[str, int] = ("127.0.0.1", 40000)) -> httpx.AsyncClient:
        # raise_app_exceptions=False: an unhandled error is seen as the 500 response a client would get.
        transport = httpx.ASGITransport(
            app=create_app(self.services), client=client, raise_app_exceptions=False
        )
        return httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=10.0)

    async def new_client(self, name: str) -> tuple[str, str]:
        info, secret = await self.clients.create(name)
        return info.client_id, secret


SERVICE_SECRET = "unit-test-service-secret-0123456789abcdefghijklmnop"


async def build_api(
    world: World | None = None,
    *,
    max_upload_bytes: int = 2 * 1024 * 1024,
    max_image_pixels: int = 40_000_000,
    wait_for_result_timeout_s: float = 0.3,
    public_base_url: str | None = None,
    login_failures_per_window: int = 3,
    login_window_s: int = 300,
    login_backoff_max_s: int = 900,
    unauthenticated_per_minute: int = 10_000,
    trusted_proxies: tuple[str, ...] = (),
    requests_per_minute: int = 10_000,
    limiter_clock: Callable[[], float] = time.time,
    access_ttl_s: int = 900,
    proof_ttl_s: int = 900,
) -> Api:
    world = world if world is not None else World()
    clients = FakeClientStore()
    limiter = FakeRateLimiter(limiter_clock)
    auth = ClientAuthenticator(
        clients,
        limiter,
        FakeRequestAdmission(clients, limiter),
        login_failures_per_window=login_failures_per_window,
        login_window_s=login_window_s,
        requests_per_minute=requests_per_minute,
        login_backoff_max_s=login_backoff_max_s,
        unauthenticated_per_minute=unauthenticated_per_minute,
    )
    signer = TokenSigner(SERVICE_SECRET, access_ttl_s=access_ttl_s, proof_ttl_s=proof_ttl_s)
    services = ApiServices(
        transactions=world.transaction_service(max_image_pixels),
        proofs=ProofService(world.record_store, world.blobs),
        auth=auth,
        signer=signer,
        max_upload_bytes=max_upload_bytes,
        wait_for_result_timeout_s=wait_for_result_timeout_s,
        public_base_url=public_base_url,
        trusted_proxies=parse_networks(trusted_proxies),
    )
    info, secret = await clients.create("tenant-a")
    return Api(world, signer, clients, limiter, auth, services, info.client_id, secret)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.002)


def assert_error_envelope(body: Any) -> None:
    assert isinstance(body, dict), body
    assert set(body) == {"status", "message", "errors"}, body
    assert body["status"] is False
    assert isinstance(body["message"], str) and body["message"]
    assert isinstance(body["errors"], dict)
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in body["errors"].items())

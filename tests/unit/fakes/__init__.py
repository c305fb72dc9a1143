"""In-memory fakes behind the store interfaces of serve_app/stores/interfaces.py, for unit tests only.

They honour the Protocol semantics the pipelines rely on:
- transactions: a final state is never overwritten; mark_processing refuses unknown and final ones;
- work queue: consumer-group semantics: claim hands out undelivered entries, an entry stays pending until
  acknowledged, reclaim_stale hands pending entries idle for min_idle_ms to another consumer and bumps their
  delivery count; asking for zero entries is refused as Redis refuses COUNT 0; prune_consumers forgets
  consumers other than the caller that hold no pending entry and have been idle for the given time;
- gallery: search is filtered by tenant and min_similarity (inner product of unit vectors) and sorted by
  similarity, best first;
- records: reference_lock is a real mutual-exclusion lock per (tenant, client_reference); the latest face of
  a reference is the one with the newest created_at (of equal ones, the greatest face_id);
- rate limiter: fixed windows counting every hit, like the Redis limiter;
- webhooks: the fake transaction store queues a completion event when it makes a transaction final and the
  tenant has an endpoint; a claim leases its events for the time given, and a settle by a claim that
  was overtaken is logged but changes nothing.

tests/contracts/ runs one suite per store interface against each fake here and its real store, so a fake
that drifts from the real store fails there: change a fake together with its contract test.

Every fake yields to the event loop on each call (as a network store would), so concurrent callers really
interleave, and can be told to fail (`Faults`) to simulate a backend outage or a crash between two steps.
Keys and values are encoded as UTF-8 like a byte-keyed store (Redis) does, so a string that cannot be stored
fails here as it would there.
"""

from __future__ import annotations

from tests.unit.fakes.audit import FakeAuditLog
from tests.unit.fakes.blobs import FakeBlobStore
from tests.unit.fakes.clients import FakeClientStore, FakeRateLimiter, FakeRequestAdmission
from tests.unit.fakes.common import EMBEDDING_SIZE, Faults, ManualClock
from tests.unit.fakes.gallery import FakeGalleryStore
from tests.unit.fakes.images import image_bytes, jpeg, solid_png, uniform_png
from tests.unit.fakes.models import (
    Color,
    ScriptedAnalysis,
    age_estimate,
    at_cosine,
    embedding,
    face,
    face_quality,
    quality,
)
from tests.unit.fakes.records import FakeFaceRecordStore, NonExclusiveRecordStore
from tests.unit.fakes.transactions import FakeTransactionStore
from tests.unit.fakes.webhooks import FakeWebhookStore
from tests.unit.fakes.work_queue import FakeWorkQueue
from tests.unit.fakes.world import (
    SERVICE_SECRET,
    TEST_LOCK,
    TEST_POLICY,
    Api,
    World,
    assert_error_envelope,
    build_api,
    wait_until,
)

__all__ = [
    "EMBEDDING_SIZE",
    "SERVICE_SECRET",
    "TEST_LOCK",
    "TEST_POLICY",
    "Api",
    "Color",
    "FakeAuditLog",
    "FakeBlobStore",
    "FakeClientStore",
    "FakeFaceRecordStore",
    "FakeGalleryStore",
    "FakeRateLimiter",
    "FakeRequestAdmission",
    "FakeTransactionStore",
    "FakeWebhookStore",
    "FakeWorkQueue",
    "Faults",
    "ManualClock",
    "NonExclusiveRecordStore",
    "ScriptedAnalysis",
    "World",
    "age_estimate",
    "assert_error_envelope",
    "at_cosine",
    "build_api",
    "embedding",
    "face",
    "face_quality",
    "image_bytes",
    "jpeg",
    "quality",
    "solid_png",
    "uniform_png",
    "wait_until",
]

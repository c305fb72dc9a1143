"""What Redis holds per transaction, per enrolled face, per Idempotency-Key (and per tenant), and for how
long: `MEMORY USAGE` (SAMPLES 0) of every key the real stores leave, on an embedded redis-server
(127.0.0.1), after the stores' own operations.

    python -m bench.redis_memory [--count 1000]

One lifecycle, as the service drives it, `--count` times over: a keyed face search is created (its image key,
an Idempotency-Key) for a tenant with a webhook endpoint, claimed, marked processing, completed with 10
matches and enrolled, acknowledged; its face's record is written (with a 24-character client_reference); its
webhook event is claimed and settled delivered; the result archiver moves it out of Redis. Besides: one
age estimation's hash, and `--count` erasures (tombstone and audit entry), clients counted by the rate
limiter and tenants' gallery clocks. The same is run a second time with twice the count under another key
prefix, and each family's bytes per item are the difference of the two runs' totals over the difference of
the counts, so what a shared key (a stream, a sorted set) costs once is not spread over its items. The
time-to-live is the one Redis reports (PTTL) right after the write; what bounds the rest is the code's.
MEMORY USAGE counts the key, its value and its keyspace entry, not its entry in the table of expiries: the
last row is that, the growth of used_memory per key between keys set with and without a time-to-live.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from redis.asyncio import Redis

from bench.common import format_table
from serve_app.domain.faces import FaceRecord
from serve_app.domain.gallery import AuditAction, AuditEntry
from serve_app.domain.idempotency import IdempotencyClaim
from serve_app.domain.outcomes import AgeEstimationOutcome, FaceMatch, FaceSearchOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, upload_key
from serve_app.domain.webhooks import DeliveryAttempt, Settlement
from serve_app.launch.embedded import EmbeddedRedis
from serve_app.pipelines.result_archive import archive_finished
from serve_app.settings import AuthSettings, RedisSettings, Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import request_counter_key
from serve_app.stores.redis_support import connect_redis, text
from serve_app.stores.redis_tenant_clock import RedisTenantClock
from serve_app.stores.result_archive import BlobResultArchive
from serve_app.wiring.stores import redis_stores
from serve_app.wiring.webhooks import webhook_store

# family -> (per what, what removes it besides a time-to-live). The families of the store docstrings.
FAMILIES: dict[str, tuple[str, str]] = {
    "txn (queued)": ("transaction", "becomes the final hash below"),
    "sys:tx-queue entry": ("queued transaction", "deleted when acknowledged (final)"),
    "idem": ("keyed create", "-"),
    "txn (face search, final)": ("transaction", "moved to the result archive after the hot window (24 h)"),
    "txn (age estimation, final)": ("transaction", "moved to the result archive after the hot window (24 h)"),
    "txn-done": ("final transaction", "-"),
    "sys:tx-finished entry": ("final transaction", "deleted when archived (hot window, 24 h)"),
    "wh-event (pending)": ("final transaction, tenant with a webhook", "settled: delivered or dead"),
    "sys:wh-due + wh-born entries": ("undelivered event", "removed when settled"),
    "wh-event (settled)": ("final transaction, tenant with a webhook", "-"),
    "after the archive": ("transaction", "nothing of it is left in Redis"),
    "face record + indexes": ("enrolled face", "kept while enrolled (the client's gallery)"),
    "erased tombstone": ("erased client_reference", "-"),
    "audit entry": ("deletion or erasure request", "dropped by the next append once past its retention"),
    "wh-log": (
        "tenant with a webhook (its last 100 attempts)",
        "trimmed to FACESEARCH_WEBHOOK_LOG_SIZE per tenant",
    ),
    "rl (request window)": ("client, per minute it sends", "the rest of its 1-minute window"),
    "gallery-clock": ("tenant with faces", "kept (one per tenant)"),
}
KEY_FAMILIES = {
    "txn": re.compile(r"txn:"),
    "txn-done": re.compile(r"txn-done:"),
    "idem": re.compile(r"idem:"),
    "sys:tx-queue entry": re.compile(r"sys:tx-queue$"),
    "sys:tx-finished entry": re.compile(r"sys:tx-finished$"),
    "wh-event": re.compile(r"wh-event:"),
    "sys:wh-due + wh-born entries": re.compile(r"sys:wh-(due|born)$"),
    "face record + indexes": re.compile(r"(face|faces|faces-by-id|faces-by-time|ref|refs):"),
    "erased tombstone": re.compile(r"erased:"),
    "audit entry": re.compile(r"audit:"),
    "wh-log": re.compile(r"wh-log:"),
    "rl (request window)": re.compile(r"rl:"),
    "gallery-clock": re.compile(r"gallery-clock:"),
}


async def family_usage(redis: Redis, prefix: str) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per family of every key under prefix, and the family's longest PTTL (-1: none)."""
    usage: dict[str, int] = defaultdict(int)
    ttl_ms: dict[str, int] = {}
    cursor: int | None = None
    while cursor != 0:
        cursor, raw = await redis.scan(cursor or 0, match=f"{prefix}*", count=1000)
        keys = [text(key) for key in raw]
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.memory_usage(key, samples=0)
                pipe.pttl(key)
            replies = await pipe.execute() if keys else []
        for index, key in enumerate(keys):
            for family, pattern in KEY_FAMILIES.items():
                if pattern.match(key, len(prefix)):
                    usage[family] += int(replies[2 * index] or 0)
                    ttl_ms[family] = max(ttl_ms.get(family, -1), int(replies[2 * index + 1]))
    return usage, ttl_ms


def ttl_words(ms: int | None) -> str:
    """A PTTL read a little after the write (the scan takes a moment), in the unit it was given in."""
    if ms is None:
        return "-"
    if ms < 0:
        return "none"
    seconds = ms / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 0.98 * size and abs(seconds / size - round(seconds / size)) < 0.02:
            return f"{round(seconds / size)} {unit}"
    return f"{math.ceil(seconds)} s"


def outcome() -> FaceSearchOutcome:
    matches = tuple(FaceMatch(f"f{uuid.uuid4().hex}", round(0.95 - i / 40, 6), "") for i in range(10))
    return FaceSearchOutcome(is_face_found=True, matches=matches, enrolled=True)


async def lifecycle(url: str, count: int, results: Path) -> dict[str, tuple[int, str]]:
    """`count` of everything under a fresh prefix: {family: (bytes in all, TTL right after the write)}."""
    prefix = f"m{uuid.uuid4().hex[:6]}:"
    settings = Settings(
        redis=RedisSettings(url=url, key_prefix=prefix),
        auth=AuthSettings(secret_key="bench-redis-memory-0123456789abcdefghijklmnopqrstuvwxyz"),
    )
    stores = redis_stores(settings)
    redis, transactions = stores.redis, stores.transactions
    hooks = webhook_store(settings, redis)
    clock = RedisTenantClock(redis, prefix=prefix)
    tenant = "cl_" + uuid.uuid4().hex[:24]
    await hooks.set_url(tenant, "https://hooks.example.com/facesearch")
    measured: dict[str, tuple[int, str]] = {}

    async def snapshot(label: str, family: str) -> None:
        usage, ttl_ms = await family_usage(redis, prefix)
        measured[label] = (usage.get(family, 0), ttl_words(ttl_ms.get(family)))

    now = time.time()
    txs = []
    for _ in range(count):
        reference_id = uuid.uuid4().hex
        tx = Transaction(
            reference_id, tenant, TransactionKind.FACE_SEARCH, TransactionState.QUEUED, now, now,
            upload_key(tenant, reference_id), enroll_face=True,
            client_reference=f"customer-{uuid.uuid4().hex[:15]}",
        )  # fmt: skip
        txs.append(tx)
        await transactions.create_and_enqueue(tx, IdempotencyClaim(tenant, uuid.uuid4().hex, "f" * 64))
    for label, family in [
        ("txn (queued)", "txn"),
        ("sys:tx-queue entry", "sys:tx-queue entry"),
        ("idem", "idem"),
    ]:
        await snapshot(label, family)

    entries = await transactions.claim("bench", count, 0)
    for tx, entry in zip(txs, entries, strict=True):
        await transactions.mark_processing(entry.reference_id)
        await transactions.complete(entry.reference_id, outcome())
        await stores.records.put(
            FaceRecord(
                f"f{tx.reference_id}", tenant, tx.client_reference, tx.image_key, "v2", now, tx.reference_id
            )
        )
    await transactions.ack([entry.entry_id for entry in entries])
    for label, family in [
        ("txn (face search, final)", "txn"),
        ("txn-done", "txn-done"),
        ("sys:tx-finished entry", "sys:tx-finished entry"),
        ("wh-event (pending)", "wh-event"),
        ("sys:wh-due + wh-born entries", "sys:wh-due + wh-born entries"),
        ("face record + indexes", "face record + indexes"),
    ]:
        await snapshot(label, family)

    for event in await hooks.claim_due(time.time() + 1, 60, count):
        attempt = DeliveryAttempt(
            event.event_id, event.reference_id, 1, time.time(), "delivered", 204, None, 35.0, None
        )
        await hooks.settle(event, Settlement.DELIVERED, attempt)
    await snapshot("wh-event (settled)", "wh-event")
    await snapshot("wh-log", "wh-log")

    archive = BlobResultArchive(LocalBlobStore(results / prefix.strip(":")), 30 * 86400)
    await archive_finished(transactions, archive, 0.0, batch=1000, max_batches=count)
    await redis.delete(*[f"{prefix}txn-done:{tx.reference_id}" for tx in txs])
    usage, _ = await family_usage(redis, prefix)
    left = sum(usage.get(family, 0) for family in ("txn", "txn-done", "sys:tx-finished entry"))
    measured["after the archive"] = (left, "-")

    for index in range(count):
        reference_id = uuid.uuid4().hex
        age = replace(
            txs[index], reference_id=reference_id, kind=TransactionKind.AGE_ESTIMATION,
            image_key=upload_key(tenant, reference_id), client_reference=None,
        )  # fmt: skip
        await transactions.create_and_enqueue(age)
        await transactions.complete(age.reference_id, AgeEstimationOutcome(31, 0, 0, enrolled=True))
        reference = f"customer-{uuid.uuid4().hex[:15]}"
        await stores.records.mark_erased(tenant, reference, now)
        await stores.audit.append(tenant, AuditEntry(now, tenant, AuditAction.ERASE_REFERENCE, 1, "s" * 64))
        await stores.limiter.hit(request_counter_key("cl_" + uuid.uuid4().hex[:24]), 6000, 60)
        await clock.advance("cl_" + uuid.uuid4().hex[:24], 460_000_000_000_000_000 + index)
    await snapshot("txn (age estimation, final)", "txn")
    await snapshot("erased tombstone", "erased tombstone")
    await snapshot("audit entry", "audit entry")
    await snapshot("rl (request window)", "rl (request window)")
    await snapshot("gallery-clock", "gallery-clock")
    await redis.aclose()
    return measured


async def expiry_entry(url: str, count: int = 20_000) -> float:
    """used_memory per key set with a time-to-live, less that of a key set without one."""
    redis = connect_redis(url)
    growth = []
    for ttl in (None, 86400):
        prefix = f"x{uuid.uuid4().hex[:6]}:"
        before = int((await redis.info("memory"))["used_memory"])
        async with redis.pipeline(transaction=False) as pipe:
            for index in range(count):
                pipe.set(f"{prefix}{index:032x}", "1", ex=ttl)
            await pipe.execute()
        growth.append(int((await redis.info("memory"))["used_memory"]) - before)
        async with redis.pipeline(transaction=False) as pipe:
            for index in range(count):
                pipe.delete(f"{prefix}{index:032x}")
            await pipe.execute()
    await redis.aclose()
    return (growth[1] - growth[0]) / count


async def measure(url: str, count: int) -> list[list[str]]:
    with tempfile.TemporaryDirectory() as results:
        small = await lifecycle(url, count, Path(results))
        large = await lifecycle(url, 2 * count, Path(results))
    rows = []
    for label, (per, bound) in FAMILIES.items():
        each = (large[label][0] - small[label][0]) / count
        if label == "wh-log":  # bounded per tenant: its whole size, not per attempt
            each = large[label][0]
        rows.append([label, per, f"{each:,.0f}", large[label][1], bound])
    each = await expiry_entry(url)
    rows.append(["(the expiry of a key)", "key with a TTL, besides the above", f"{each:,.0f}", "-", "-"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="items per family in the first run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data, EmbeddedRedis(Path(data)) as server:
        rows = asyncio.run(measure(server.url, args.count))
    print(format_table(["family", "per", "bytes", "TTL at write", "removed besides the TTL"], rows))


if __name__ == "__main__":
    main()

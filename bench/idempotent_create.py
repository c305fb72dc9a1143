"""What an idempotent create costs at the Redis store: the create as the store made it before (one MULTI/EXEC
pipeline: HSET, HINCRBY, XADD) against the create script now, without an Idempotency-Key and with one, and a
retry answered from the key's record; in one run against an embedded redis-server on 127.0.0.1.

    python -m bench.idempotent_create [--rounds 2000] [--blocks 5]

Each way runs in `blocks` blocks of `rounds` creates, the ways taking turns block by block, so a drift of
the machine's load hits them alike. Columns: the median over blocks of the wall time per create (round trip
included) and of this process' CPU per create; the Redis memory one key's record adds (MEMORY USAGE).
Redis-server's own CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from bench.common import format_table, scratch_redis
from serve_app.domain.idempotency import IdempotencyClaim
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.transaction_codec import encode_transaction


def new_tx() -> Transaction:
    now = time.time()
    reference_id = new_reference_id()
    return Transaction(
        reference_id=reference_id,
        tenant_id="cl_" + "a" * 24,
        kind=TransactionKind.FACE_SEARCH,
        state=TransactionState.QUEUED,
        created_at=now,
        updated_at=now,
        image_key=f"uploads/cl_{'a' * 24}/{reference_id}",
        enroll_face=True,
        client_reference="customer-0001",
    )


def claim() -> IdempotencyClaim:
    return IdempotencyClaim("cl_" + "a" * 24, str(uuid.uuid4()), "f" * 64)


async def measured(call: Callable[[], Awaitable[object]], rounds: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per call over `rounds` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        await call()
    return (time.perf_counter() - wall) * 1e6 / rounds, (time.process_time() - cpu) * 1e6 / rounds


async def run(url: str, rounds: int, blocks: int) -> tuple[list[list[str]], int]:
    redis: Redis = connect_redis(url)
    store = RedisTransactionStore(redis, "bench-idem:", idempotency_ttl_s=3600)
    retried = claim()
    await store.create_and_enqueue(new_tx(), retried)

    async def before() -> None:
        tx = new_tx()
        fields: dict[FieldT, EncodableT] = {key: value for key, value in encode_transaction(tx).items()}
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(f"bench-idem:txn:{tx.reference_id}", mapping=fields)
            pipe.hincrby("bench-idem:sys:tx-counts", tx.state.value, 1)
            pipe.xadd("bench-idem:sys:tx-queue", {"ref": tx.reference_id})
            await pipe.execute()

    async def unkeyed() -> None:
        await store.create_and_enqueue(new_tx())

    async def keyed() -> None:
        await store.create_and_enqueue(new_tx(), claim())

    async def retry() -> None:
        await store.create_and_enqueue(new_tx(), retried)

    ways: dict[str, Callable[[], Awaitable[None]]] = {
        "before: MULTI pipeline": before,
        "now: script, no key": unkeyed,
        "now: script, with a key": keyed,
        "now: a retry with that key": retry,
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    try:
        for way in ways.values():
            await way()  # the scripts loaded, the connections open
        for _ in range(blocks):
            for name, way in ways.items():
                samples[name].append(await measured(way, rounds))
        record = int(await redis.memory_usage(f"bench-idem:idem:{retried.digest}") or 0)
        await redis.delete("bench-idem:sys:tx-queue")
    finally:
        await redis.aclose()
    rows = [
        [
            name,
            f"{statistics.median(wall for wall, _ in results):.0f}",
            f"{statistics.median(cpu for _, cpu in results):.0f}",
        ]
        for name, results in samples.items()
    ]
    return rows, record


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    with scratch_redis() as url:
        rows, record = asyncio.run(run(url, args.rounds, args.blocks))
    print(format_table(["create", "wall µs", "client CPU µs"], rows))
    print(f"\nRedis memory of one key's record: {record} bytes")


if __name__ == "__main__":
    main()

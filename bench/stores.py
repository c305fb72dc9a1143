"""Latency of the Redis transaction store's waits on an embedded redis-server (127.0.0.1).

    python -m bench.stores [--rounds 200]

Rows: how long after complete() a waiter blocked in wait_final() gets the final state (the long poll's
and wait_for_result's wake-up); how long wait_final() takes for a transaction that is already final; and
how long claim() takes to hand out an entry added while it was blocking. Waiter and completer use two
connections, as ingress and worker do. These numbers used to be assertions in the store tests (p50 < 25 ms);
tests now assert the behaviour and this prints the speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from bench.common import format_table, scratch_redis
from serve_app.domain.outcomes import AgeEstimationOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore


def new_tx() -> Transaction:
    now = time.time()
    return Transaction(
        reference_id=new_reference_id(),
        tenant_id="bench",
        kind=TransactionKind.AGE_ESTIMATION,
        state=TransactionState.QUEUED,
        created_at=now,
        updated_at=now,
        image_key=f"uploads/bench/{uuid.uuid4().hex}",
        enroll_face=False,
    )


def row(name: str, samples_ms: list[float]) -> list[str]:
    ordered = sorted(samples_ms)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return [name, f"{statistics.median(ordered):.2f}", f"{p95:.2f}", f"{ordered[-1]:.2f}", str(len(ordered))]


async def measure(url: str, rounds: int) -> list[list[str]]:
    waiter_redis, worker_redis = connect_redis(url), connect_redis(url)
    prefix = f"bench{uuid.uuid4().hex[:6]}:"
    waiter = RedisTransactionStore(waiter_redis, prefix=prefix)
    worker = RedisTransactionStore(worker_redis, prefix=prefix)
    wake, final, claim = [], [], []
    try:
        for _ in range(rounds):
            tx = new_tx()
            await waiter.create_and_enqueue(tx)
            await worker.claim("bench", count=1, block_ms=100)
            waiting = asyncio.create_task(waiter.wait_final(tx.reference_id, 5.0))
            await asyncio.sleep(0.005)  # let it block
            completed_at = time.perf_counter()
            await worker.complete(
                tx.reference_id, AgeEstimationOutcome(age=None, under_18=None, under_21=None)
            )
            await waiting
            wake.append((time.perf_counter() - completed_at) * 1000)

            started = time.perf_counter()
            await waiter.wait_final(tx.reference_id, 5.0)
            final.append((time.perf_counter() - started) * 1000)

            blocked = asyncio.create_task(worker.claim("bench", count=1, block_ms=2000))
            await asyncio.sleep(0.005)
            added_at = time.perf_counter()
            await waiter.create_and_enqueue(new_tx())
            await blocked
            claim.append((time.perf_counter() - added_at) * 1000)
    finally:
        await waiter_redis.aclose()
        await worker_redis.aclose()
    return [
        row("wait_final wake-up after complete()", wake),
        row("wait_final on a final transaction", final),
        row("claim() hand-out of an entry added while blocking", claim),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    with scratch_redis() as redis_url:
        rows = asyncio.run(measure(redis_url, args.rounds))
    print(format_table(["what", "p50 ms", "p95 ms", "max ms", "n"], rows))


if __name__ == "__main__":
    main()

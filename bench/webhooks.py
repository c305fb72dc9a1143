"""What a completion webhook costs the worker per transaction, against an embedded redis-server and a
receiver in another process, both on 127.0.0.1.

    python -m bench.webhooks [--events 2000] [--blocks 5]

Rows: making a transaction final (the store's complete(), one script) as it was before webhooks, for a
tenant without a webhook and for one with a webhook (the same script also queues the event); delivering
one event (claim in batches of 16, read the endpoint and the secret, read and render the transaction as
/result would, sign, POST, settle). Columns: the median over blocks of the wall time per transaction, of
this process' CPU per transaction (the receiver's and redis-server's CPU are not counted), and the Redis
commands per transaction from INFO commandstats: the client's round trips, the commands its scripts run on
the server, and each command's calls per transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from bench.common import format_table, scratch_redis
from serve_app.domain.outcomes import AgeEstimationOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.webhooks import WebhookDeliverer, WebhookPolicy, WebhookService
from serve_app.settings import AuthSettings, Settings
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.redis_webhooks import RedisWebhookStore, SecretCipher
from serve_app.wiring.webhooks import result_renderer

TENANT_WITH = "cl_" + "b" * 24
TENANT_WITHOUT = "cl_" + "c" * 24
KEY = "bench-webhooks-key-0123456789abcdef"


def _receive(port: Any) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
        port.value = server.sockets[0].getsockname()[1]
        await server.serve_forever()

    asyncio.run(serve())


async def command_counts(redis: Redis) -> dict[str, int]:
    stats: dict[str, Any] = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def tx_of(tenant: str) -> Transaction:
    now = time.time()
    reference_id = uuid.uuid4().hex
    return Transaction(
        reference_id=reference_id,
        tenant_id=tenant,
        kind=TransactionKind.AGE_ESTIMATION,
        state=TransactionState.PROCESSING,
        created_at=now,
        updated_at=now,
        image_key=f"uploads/{tenant}/{reference_id}",
        enroll_face=False,
    )


def count_round_trips(redis: Redis) -> list[int]:
    """A counter of the commands this client sends (each one a round trip: these paths use no pipeline)."""
    sent = [0]
    execute = redis.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        sent[0] += 1
        return await execute(*args, **options)

    redis.execute_command = counted  # type: ignore[method-assign]
    return sent


async def measure(
    redis: Redis, sent: list[int], events: int, step: Callable[[], Awaitable[None]]
) -> tuple[float, float, int, dict[str, int]]:
    """(wall µs, CPU µs, round trips, command calls) of `events` runs of step."""
    before = await command_counts(redis)
    trips = sent[0]
    cpu, wall = time.process_time(), time.perf_counter()
    await step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    trips = sent[0] - trips
    after = await command_counts(redis)
    after["info"] = after.get("info", 0) - 1  # our own INFO
    # A new pooled connection's handshake and the scripts' first load are not per-transaction work.
    for setup in ("client", "hello", "script"):
        after.pop(setup, None)
    calls = {
        name: count - before.get(name, 0) for name, count in after.items() if count > before.get(name, 0)
    }
    return wall / events * 1e6, cpu / events * 1e6, trips, calls


async def run(url: str, receiver: str, events: int, blocks: int) -> None:
    redis = connect_redis(url)
    sent = count_round_trips(redis)
    prefix = "bw:"
    transactions = RedisTransactionStore(redis, prefix=prefix)
    before_webhooks = RedisTransactionStore(redis, prefix=prefix, webhooks=False)  # the script as it was
    settings = Settings(auth=AuthSettings(secret_key=KEY))
    cipher = SecretCipher(settings.auth.key_ring().for_purpose("webhook-secret"))
    store = RedisWebhookStore(redis, cipher, prefix=prefix)
    policy = WebhookPolicy(allowed_hosts=frozenset({"127.0.0.1"}), batch=16)
    await WebhookService(store, policy).register(TENANT_WITH, receiver)
    reader = TransactionService(transactions, None, 1)  # type: ignore[arg-type]  # reads only

    async def load(tenant: str, reference_id: str) -> Transaction | None:
        tx = await transactions.get(reference_id)
        return await reader.readable(tx) if tx is not None else None

    deliverer = WebhookDeliverer(store, load, result_renderer(settings), policy)
    outcome = AgeEstimationOutcome(age=34, under_18=0, under_21=0)
    results: dict[str, list[tuple[float, float, int, dict[str, int]]]] = {
        "before": [],
        "without": [],
        "with": [],
        "deliver": [],
    }
    for _ in range(blocks):
        for label, tenant in (("before", TENANT_WITH), ("without", TENANT_WITHOUT), ("with", TENANT_WITH)):
            finishing = before_webhooks if label == "before" else transactions
            created = [tx_of(tenant) for _ in range(events)]
            for tx in created:  # created outside the measurement: only the final write is timed
                await transactions.create_and_enqueue(tx)
                await transactions.mark_processing(tx.reference_id)

            async def finish(
                batch: list[Transaction] = created, store: RedisTransactionStore = finishing
            ) -> None:
                for tx in batch:
                    await store.complete(tx.reference_id, outcome)

            results[label].append(await measure(redis, sent, events, finish))

        async def deliver() -> None:
            while await deliverer.run_once():
                pass

        results["deliver"].append(await measure(redis, sent, events, deliver))
    assert (await store.stats(time.time())).totals["delivered"] == events * blocks
    rows = []
    names = {
        "before": "final write, before webhooks (no check)",
        "without": "final write, tenant without a webhook",
        "with": "final write, tenant with a webhook (event queued)",
        "deliver": "delivering the event (claim, render, sign, POST, settle)",
    }
    for label, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        trips, calls = runs[-1][2], runs[-1][3]
        inside = sum(calls.values()) - trips
        listed = " ".join(f"{name} {count / events:.2g}" for name, count in sorted(calls.items()))
        rows.append(
            [
                names[label],
                f"{wall:.0f}",
                f"{cpu:.0f}",
                f"{trips / events:.2f}",
                f"{inside / events:.1f}",
                listed,
            ]
        )
    header = [
        "per transaction",
        "wall µs",
        "worker CPU µs",
        "round trips",
        "run in scripts",
        "Redis commands",
    ]
    print(format_table(header, rows))
    await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=5)
    options = parser.parse_args()
    port = multiprocessing.Value("i", 0)
    receiver = multiprocessing.Process(target=_receive, args=(port,), daemon=True)
    receiver.start()
    while port.value == 0:
        time.sleep(0.05)
    try:
        with scratch_redis() as url:
            asyncio.run(run(url, f"http://127.0.0.1:{port.value}/in", options.events, options.blocks))
    finally:
        receiver.terminate()


if __name__ == "__main__":
    main()

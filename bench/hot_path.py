"""Each per-request cut of the ingress's hot path measured on its own: CPU microseconds of this process per
call, the way before and the way now, in one run against an embedded redis-server on 127.0.0.1.

    python -m bench.hot_path [--rounds 2000]

Rows:
- bearer check: PyJWT's full verification on every request (a signer without its cache) against the
  replica's cache of verified tokens;
- admission: the client's hash then the rate-limit script (two round trips, as before) against the one
  admission script;
- result wait: the round trips of a long poll whose transaction completed just before the wait, as the
  store made them before (read in the route, read again in the store, BLPOP, put the signal back, read the
  final state) against now (read in the route, BLMOVE, read the final state);
- JSON body: parsing a face-search JSON body carrying a dev identity photo as a data URI, with the standard
  parser and its UTF-8 scan of every value against orjson;
- JSON response: rendering a face-search result with five matches, Starlette's JSONResponse against the
  API's orjson one.

The last column is the saving per face-search transaction created with JSON and read with one long poll
(two authenticated requests, one wait, one body, two responses). Redis-server's own CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import Redis
from starlette.responses import JSONResponse as StarletteJSONResponse

from bench.common import format_table, scratch_redis
from serve_app.api.json_response import JSONResponse
from serve_app.api.tokens import TokenSigner
from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, new_reference_id
from serve_app.stores.interfaces import request_counter_key
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from tests.faces_dev import load_faces_dev

SECRET = "bench-hot-path-secret-0123456789abcdef"
# How often one face-search transaction (JSON create + one long poll) takes each step.
PER_TRANSACTION = {"bearer check": 2, "admission": 2, "result wait": 1, "JSON body": 1, "JSON response": 2}


def cpu_us(call: Callable[[], object], rounds: int) -> float:
    call()  # warm-up
    started = time.process_time()
    for _ in range(rounds):
        call()
    return (time.process_time() - started) * 1e6 / rounds


async def async_cpu_us(call: Callable[[], Awaitable[object]], rounds: int) -> float:
    await call()
    started = time.process_time()
    for _ in range(rounds):
        await call()
    return (time.process_time() - started) * 1e6 / rounds


def bearer_rows(rounds: int) -> tuple[float, float]:
    uncached = TokenSigner(SECRET, access_ttl_s=900, proof_ttl_s=900, verified_cache_size=0)
    cached = TokenSigner(SECRET, access_ttl_s=900, proof_ttl_s=900)
    token, _ = cached.issue_access("cl_0123456789abcdef01234567")
    return cpu_us(lambda: uncached.verify_access(token), rounds), cpu_us(
        lambda: cached.verify_access(token), rounds
    )


async def admission_rows(redis: Redis, rounds: int) -> tuple[float, float]:
    clients = RedisClientStore(redis, pepper=SECRET, prefix="bench:")
    limiter = RedisRateLimiter(redis, prefix="bench:")
    admission = RedisRequestAdmission(redis, prefix="bench:")
    info, _ = await clients.create("bench")

    async def before() -> None:
        client = await clients.get(info.client_id)
        assert client is not None and not client.revoked
        await limiter.hit(request_counter_key(info.client_id), 10**9, 60)

    async def now() -> None:
        await admission.admit(info.client_id, 10**9, 60)

    return await async_cpu_us(before, rounds), await async_cpu_us(now, rounds)


async def wait_rows(redis: Redis, rounds: int) -> tuple[float, float]:
    store = RedisTransactionStore(redis, prefix="bench:")
    created = time.time()
    tx = Transaction(
        reference_id=new_reference_id(),
        tenant_id="cl_0123456789abcdef01234567",
        kind=TransactionKind.FACE_SEARCH,
        state=TransactionState.QUEUED,
        created_at=created,
        updated_at=created,
        image_key="uploads/bench",
        enroll_face=False,
    )
    await store.create_and_enqueue(tx)
    await store.complete(tx.reference_id, FaceSearchOutcome(is_face_found=False))
    done_key = f"bench:txn-done:{tx.reference_id}"

    async def before() -> None:
        # The route's read (it saw the transaction pending), then the store's former wait_final.
        await store.get(tx.reference_id)
        await store.get(tx.reference_id)
        popped = await redis.blpop([done_key], timeout=1)
        assert popped is not None
        async with redis.pipeline(transaction=True) as pipe:
            pipe.rpush(done_key, popped[1])
            pipe.expire(done_key, 60)
            await pipe.execute()
        await store.get(tx.reference_id)

    async def now() -> None:
        await store.get(tx.reference_id)
        await store.wait_final(tx.reference_id, 1, seen_pending=True)

    return await async_cpu_us(before, rounds), await async_cpu_us(now, rounds)


def json_body_rows(rounds: int) -> tuple[float, float]:
    photo = next(image.path for image in load_faces_dev().of_kind("identity"))
    data_uri = "data:image/jpeg;base64," + base64.b64encode(photo.read_bytes()).decode()
    body = json.dumps({"file": data_uri, "client_reference": "bench-0001", "enroll_face": 1}).encode()

    def before() -> None:
        parsed = json.loads(body)
        for key, value in parsed.items():
            key.encode("utf-8")
            if isinstance(value, str):
                value.encode("utf-8")

    return cpu_us(before, rounds), cpu_us(lambda: orjson.loads(body), rounds)


def json_response_rows(rounds: int) -> tuple[float, float]:
    matches = [
        {
            "face_id": f"f{new_reference_id()}",
            "score": 0.9731 - index / 100,
            "client_reference": f"bench-{index:04d}",
            "proof_url": f"http://127.0.0.1:8000/get-proof/{'x' * 160}",
        }
        for index in range(5)
    ]
    content: dict[str, Any] = {
        "status": True,
        "message": "Transaction result.",
        "result": {"data": {"is_face_found": 1, "matches": matches}},
    }
    return (
        cpu_us(lambda: StarletteJSONResponse(content), rounds),
        cpu_us(lambda: JSONResponse(content), rounds),
    )


async def redis_rows(url: str, rounds: int) -> dict[str, tuple[float, float]]:
    redis = connect_redis(url)
    try:
        return {
            "admission": await admission_rows(redis, rounds),
            "result wait": await wait_rows(redis, rounds),
        }
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    with scratch_redis() as redis_url:
        measured = {"bearer check": bearer_rows(args.rounds)}
        measured |= asyncio.run(redis_rows(redis_url, args.rounds))
    measured["JSON body"] = json_body_rows(max(1, args.rounds // 10))
    measured["JSON response"] = json_response_rows(args.rounds)
    rows = [
        [
            step,
            f"{before:.0f}",
            f"{now:.0f}",
            f"{PER_TRANSACTION[step]}",
            f"{(before - now) * PER_TRANSACTION[step] / 1000:.2f}",
        ]
        for step, (before, now) in measured.items()
    ]
    total = sum((before - now) * PER_TRANSACTION[step] for step, (before, now) in measured.items()) / 1000
    rows.append(["total", "", "", "", f"{total:.2f}"])
    print(format_table(["step", "before us CPU", "now us CPU", "per transaction", "ms saved per tx"], rows))


if __name__ == "__main__":
    main()

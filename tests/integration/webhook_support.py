"""What the webhook tests share: a real HTTP receiver on 127.0.0.1 whose behaviour each test sets, the
webhook pipeline on a real Redis, and a child process that delivers (killed mid-delivery by a test):
`python -m tests.integration.webhook_support REDIS_URL PREFIX` delivers until killed."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from serve_app.domain.outcomes import AgeEstimationOutcome
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.webhooks import Resolve, WebhookDeliverer, WebhookPolicy, WebhookService
from serve_app.settings import AuthSettings, Settings
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.redis_webhooks import RedisWebhookStore, SecretCipher
from serve_app.wiring.webhooks import result_renderer, webhook_resolver
from tests.unit.fakes import FakeBlobStore

KEY = "webhook-test-key-0123456789abcdef"
TENANT = "cl_0123456789abcdef01234567"
# The tests' receivers listen on 127.0.0.1: allowed explicitly, as an operator would.
ALLOWED = frozenset({"127.0.0.1"})
CHILD_LEASE_S = 6.0


def settings() -> Settings:
    return Settings(auth=AuthSettings(secret_key=SecretStr(KEY)), data_dir=Path("/nonexistent-webhook-tests"))


def policy(**overrides: float | int | frozenset[str]) -> WebhookPolicy:
    values: dict[str, object] = {
        "allowed_hosts": ALLOWED,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 2.0,
        "total_timeout_s": 3.0,
        "retry_base_s": 0.05,
        "retry_max_delay_s": 0.2,
        "lease_s": 4.0,
        "idle_poll_s": 0.05,
    }
    values.update(overrides)
    return WebhookPolicy(**values)  # type: ignore[arg-type]


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    target: str = ""  # the request line's target, as it came


@dataclass
class Receiver:
    """An HTTP/1.1 server on 127.0.0.1. answer(n) gives the n-th request's (delay_s, status); a delay of
    None holds the request unanswered (until the server stops)."""

    answer: Callable[[int], tuple[float | None, int]] = lambda _n: (0.0, 204)
    port: int = 0
    received: list[Received] = field(default_factory=list)
    connections: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/facesearch?source=test"

    async def start(self) -> Receiver:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1] if lines[0].count(" ") == 2 else ""
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.received.append(Received(headers, body, target))
            self.arrived.set()
            delay, status = self.answer(len(self.received))
            if delay is None:
                await asyncio.Event().wait()  # never answers
                return
            await asyncio.sleep(delay)
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def event_ids(self) -> list[str]:
        return [item.headers["webhook-id"] for item in self.received]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Pipeline:
    transactions: RedisTransactionStore
    store: RedisWebhookStore
    service: WebhookService
    resolve: Resolve  # the system's resolver on a pool of its own, as the wiring builds it

    def deliverer(self, policy: WebhookPolicy, **kwargs: object) -> WebhookDeliverer:
        reader = TransactionService(self.transactions, FakeBlobStore(), 10_000_000)

        async def load(tenant: str, reference_id: str) -> Transaction | None:
            tx = await self.transactions.get(reference_id)
            return await reader.readable(tx) if tx is not None and tx.tenant_id == tenant else None

        kwargs.setdefault("resolve", self.resolve)
        return WebhookDeliverer(self.store, load, result_renderer(settings()), policy, **kwargs)  # type: ignore[arg-type]

    async def finish(self, reference_id: str, *, fail: bool = False) -> None:
        """Create a transaction of the tenant and make it final, as a worker does."""
        await finish(self.transactions, TENANT, reference_id, fail=fail)


async def finish(
    transactions: RedisTransactionStore, tenant: str, reference_id: str, *, fail: bool = False
) -> None:
    """Create an age estimation of the tenant and make it final, as a worker does (its event is queued
    when the tenant has a webhook)."""
    now = time.time()
    tx = Transaction(
        reference_id=reference_id,
        tenant_id=tenant,
        kind=TransactionKind.AGE_ESTIMATION,
        state=TransactionState.QUEUED,
        created_at=now,
        updated_at=now,
        image_key=f"uploads/{tenant}/{reference_id}",
        enroll_face=False,
    )
    await transactions.create_and_enqueue(tx)
    await transactions.mark_processing(reference_id)
    if fail:
        await transactions.fail(reference_id, "no face found")
    else:
        await transactions.complete(reference_id, AgeEstimationOutcome(age=31, under_18=0, under_21=0))


def pipeline(redis_url: str, prefix: str, webhook_policy: WebhookPolicy) -> Pipeline:
    redis = connect_redis(redis_url)
    transactions = RedisTransactionStore(redis, prefix=prefix)
    cipher = SecretCipher(settings().auth.key_ring().for_purpose("webhook-secret"))
    store = RedisWebhookStore(redis, cipher, prefix=prefix, log_size=50, event_retention_s=3600)
    resolve = webhook_resolver(2, "webhook-test-dns")
    return Pipeline(transactions, store, WebhookService(store, webhook_policy, resolve), resolve)


async def _child(redis_url: str, prefix: str) -> None:
    # Killed long before its attempt could time out; the parent takes the event over once the lease lapses.
    deliverer = pipeline(redis_url, prefix, policy()).deliverer(
        policy(total_timeout_s=5.0, lease_s=CHILD_LEASE_S)
    )
    print("ready", flush=True)
    await deliverer.run(asyncio.Event())


if __name__ == "__main__":
    asyncio.run(_child(sys.argv[1], sys.argv[2]))

"""Webhook endpoints and the delivery of completion events (docs/api.md, "Webhooks").

WebhookService is what the API and the CLI call: register (the URL vetted against the address rules
before it is stored), rotate the secret, read the delivery log, redeliver.

WebhookDeliverer is the loop each worker replica runs beside its transaction consumer: it claims due
events from Redis with a lease, renders each from the transaction as /result would answer it, signs it and
POSTs it to the address its host resolved to and that passed the rules (pinned: no second lookup). A 2xx
answer delivers; anything else (another status, a refusal, a timeout, a connection error) is retried with
exponential backoff and full jitter until give_up_after_s has passed since the event was queued, then the
event is dead. A worker that dies mid-delivery settles nothing: the event is due again when its lease
runs out, so it is delivered at least once. Nothing here runs in a transaction's path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from serve_app.domain.errors import BackendUnavailable, NotFound, ValidationFailed
from serve_app.domain.transactions import Transaction
from serve_app.domain.webhooks import (
    EventType,
    IPAddress,
    WebhookUrl,
    event_payload,
    literal_address,
    parse_url,
    retry_delay_s,
    signature_header,
    vet_addresses,
)
from serve_app.stores.redis_webhooks import (
    ClaimedEvent,
    DeliveryAttempt,
    QueueStats,
    RedisWebhookStore,
    SecretUnreadable,
    WebhookConfig,
)

logger = logging.getLogger(__name__)

USER_AGENT = "facesearch-webhooks/1"


@dataclass(frozen=True)
class WebhookPolicy:
    allowed_hosts: frozenset[str] = frozenset()
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    total_timeout_s: float = 15.0
    max_response_bytes: int = 16 * 1024
    retry_base_s: float = 5.0
    retry_max_delay_s: float = 3600.0
    give_up_after_s: float = 24 * 3600.0
    lease_s: float = 60.0
    batch: int = 16
    idle_poll_s: float = 1.0
    secret_grace_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if self.lease_s <= self.total_timeout_s:
            raise ValueError("the delivery lease must outlast an attempt's total timeout")


class Resolve(Protocol):
    async def __call__(self, host: str, port: int) -> list[str]: ...


class Send(Protocol):
    async def __call__(
        self, addresses: list[IPAddress], url: WebhookUrl, headers: list[tuple[str, str]], body: bytes,
        policy: WebhookPolicy,
    ) -> int: ...  # fmt: skip


async def system_resolve(host: str, port: int) -> list[str]:
    """Every address the host resolves to (getaddrinfo runs in the loop's executor, never blocking it)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class DeliveryFailed(Exception):
    """An attempt that got no status: refused by the rules, no connection, a timeout, a broken answer."""


async def post_pinned(
    addresses: list[IPAddress], url: WebhookUrl, headers: list[tuple[str, str]], body: bytes,
    policy: WebhookPolicy,
) -> int:  # fmt: skip
    """POST body to the first of the vetted addresses that accepts a connection, naming the URL's host in
    Host and in TLS (SNI and certificate check); returns the status code. Reads at most max_response_bytes
    (the status line must fit) and nothing after the status: redirects are not followed, a 3xx is a failed
    attempt like any non-2xx."""
    context = ssl.create_default_context() if url.https else None
    head = [f"POST {url.target} HTTP/1.1", f"Host: {url.host_header}", f"User-Agent: {USER_AGENT}"]
    head += ["Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in headers]
    request = ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            reader = writer = None
            last_error: Exception | None = None
            for address in addresses:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(
                            str(address),
                            url.port,
                            ssl=context,
                            server_hostname=url.host if context else None,
                            limit=policy.max_response_bytes,
                        ),
                        policy.connect_timeout_s,
                    )
                    break
                except (OSError, TimeoutError) as error:
                    last_error = error
            if reader is None or writer is None:
                raise DeliveryFailed(f"connect failed: {_describe(last_error)}")
            try:
                writer.write(request)
                await asyncio.wait_for(writer.drain(), policy.read_timeout_s)
                line = await asyncio.wait_for(reader.readuntil(b"\r\n"), policy.read_timeout_s)
            finally:
                writer.close()
                with suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
    except TimeoutError:
        raise DeliveryFailed(f"timed out after {policy.total_timeout_s:g} s") from None
    except asyncio.LimitOverrunError:
        raise DeliveryFailed("the answer's status line is longer than the response cap") from None
    except asyncio.IncompleteReadError:
        raise DeliveryFailed("the connection closed before a status line") from None
    except (OSError, ssl.SSLError) as error:
        raise DeliveryFailed(_describe(error)) from None
    parts = line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise DeliveryFailed("the answer is not HTTP/1.x")
    return int(parts[1])


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "no address"
    if isinstance(error, TimeoutError):
        return "connect timed out"
    return f"{type(error).__name__}: {error}"[:200]


async def vetted_addresses(url: WebhookUrl, policy: WebhookPolicy, resolve: Resolve) -> list[IPAddress]:
    """The addresses a delivery may connect to, resolved once; ValidationFailed if any is refused. A host
    the operator allows is resolved too (and pinned) but not vetted."""
    literal = literal_address(url.host)
    found = [str(literal)] if literal is not None else await resolve(url.host, url.port)
    if url.host in policy.allowed_hosts:
        if not found:
            raise ValidationFailed(f"{url.host} does not resolve.", {"url": "host does not resolve"})
        return [literal_address(text.split("%", 1)[0]) or _never(text) for text in found]
    return vet_addresses(url.host, found)


def _never(text: str) -> IPAddress:
    raise ValidationFailed(f"{text} is not an address.", {"url": "unresolvable"})


@dataclass(frozen=True)
class Registration:
    config: WebhookConfig
    secret: str | None  # shown once: when this call created it


class WebhookService:
    """The client's and the operator's side: registration with the address rules, the secret, the log."""

    def __init__(self, store: RedisWebhookStore, policy: WebhookPolicy, resolve: Resolve = system_resolve):
        self._store = store
        self._policy = policy
        self._resolve = resolve

    async def check_url(self, url: str) -> WebhookUrl:
        try:
            parsed = parse_url(url, self._policy.allowed_hosts)
            await vetted_addresses(parsed, self._policy, self._resolve)
        except OSError:  # getaddrinfo's failures (socket.gaierror)
            raise ValidationFailed(
                "The webhook URL is refused: its host does not resolve.", {"url": "host does not resolve"}
            ) from None
        return parsed

    async def register(self, tenant: str, url: str) -> Registration:
        parsed = await self.check_url(url)
        secret = await self._store.set_url(tenant, parsed.url)
        return Registration(await self.get(tenant), secret)

    async def get(self, tenant: str) -> WebhookConfig:
        config = await self._store.get(tenant)
        if config is None:
            raise NotFound("No webhook is registered.", {"webhook": "not registered"})
        return config

    async def remove(self, tenant: str) -> bool:
        return await self._store.delete(tenant)

    async def disable(self, tenant: str) -> bool:
        return await self._store.remove_url(tenant)

    async def rotate_secret(self, tenant: str) -> Registration:
        await self.get(tenant)  # only a registered webhook has a secret to rotate
        secret = await self._store.rotate_secret(tenant, self._policy.secret_grace_s)
        return Registration(await self.get(tenant), secret)

    async def deliveries(self, tenant: str, limit: int) -> list[DeliveryAttempt]:
        return await self._store.deliveries(tenant, limit)

    async def redeliver(self, tenant: str, event_id: str) -> bool:
        """True: queued again; False: already queued. NotFound for an event that is not the tenant's (or
        no longer kept: event_retention_s after it was settled)."""
        queued = await self._store.redeliver(tenant, event_id)
        if queued is None:
            raise NotFound("No such event.", {"event_id": "unknown event"})
        return queued


def iso_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


LoadTransaction = Callable[[str, str], Awaitable[Transaction | None]]
RenderResult = Callable[[Transaction], dict[str, Any]]


@dataclass(frozen=True)
class _Outcome:
    status: int | None
    error: str | None
    permanent: bool = False


class WebhookDeliverer:
    def __init__(
        self,
        store: RedisWebhookStore,
        load: LoadTransaction,
        render: RenderResult,
        policy: WebhookPolicy,
        *,
        resolve: Resolve = system_resolve,
        send: Send = post_pinned,
        on_outcome: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        """load(tenant, reference_id): the transaction as its owner reads it (None: gone). render(tx):
        the body /result answers for it (serve_app/api/results.py renders both). on_outcome: called with
        delivered, retried or dead after each settled attempt (the metrics)."""
        self._store = store
        self._load = load
        self._render = render
        self._policy = policy
        self._resolve = resolve
        self._send = send
        self._on_outcome = on_outcome or (lambda _outcome: None)
        self._clock = clock
        self._rng = rng or random.Random()
        self.attempts = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until stop is set; while nothing is due, look again every idle_poll_s."""
        while not stop.is_set():
            try:
                claimed = await self.run_once()
            except BackendUnavailable as error:
                logger.warning("webhook delivery: %s", error.message)
                claimed = 0
            if claimed == 0:
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._policy.idle_poll_s)

    async def queue_stats(self) -> QueueStats:
        return await self._store.stats(self._clock())

    async def run_once(self) -> int:
        """Claim the due events (up to batch) and attempt each once, concurrently; returns how many."""
        events = await self._store.claim_due(self._clock(), self._policy.lease_s, self._policy.batch)
        results = await asyncio.gather(*(self._deliver(event) for event in events), return_exceptions=True)
        for event, result in zip(events, results, strict=True):
            if isinstance(result, BaseException):
                # Not settled (Redis away, a bug): the lease lapses and the event is due again.
                logger.warning("webhook event %s not settled: %r", event.event_id, result)
        return len(events)

    async def _deliver(self, event: ClaimedEvent) -> None:
        started = time.perf_counter()
        self.attempts += 1
        outcome = await self._attempt(event)
        duration_ms = (time.perf_counter() - started) * 1000
        now = self._clock()
        delivered = outcome.status is not None and 200 <= outcome.status < 300
        expired = now - event.since_ms / 1000 >= self._policy.give_up_after_s
        next_due = None
        if delivered:
            kind, words = "delivered", "delivered"
        elif outcome.permanent or expired:
            kind, words = "dead", "dead"
        else:
            delay = retry_delay_s(
                event.attempt, self._policy.retry_base_s, self._policy.retry_max_delay_s, self._rng
            )
            # Never past the give-up time: the last retry comes at the end of the window, not after it.
            next_due = min(now + delay, event.since_ms / 1000 + self._policy.give_up_after_s)
            kind, words = "retry", "retrying"
        record = DeliveryAttempt(
            event_id=event.event_id,
            reference_id=event.reference_id,
            attempt=event.attempt,
            at=now,
            outcome=words,
            status_code=outcome.status,
            error=outcome.error,
            duration_ms=round(duration_ms, 1),
            next_attempt_at=next_due,
        )
        if await self._store.settle(event, kind, record, next_due):
            self._on_outcome({"retry": "retried"}.get(kind, kind))

    async def _attempt(self, event: ClaimedEvent) -> _Outcome:
        try:
            url, keys = await self._store.signing_keys(event.tenant)
        except SecretUnreadable as error:
            logger.error("webhook event %s: %s", event.event_id, error)
            return _Outcome(None, "the signing secret cannot be read (rotate it)", permanent=True)
        if url is None:
            return _Outcome(None, "no webhook URL registered", permanent=True)
        tx = await self._load(event.tenant, event.reference_id)
        if tx is None:
            return _Outcome(None, "the transaction is no longer stored", permanent=True)
        body = self.body(event, tx)
        timestamp = int(self._clock())
        headers = [
            ("webhook-id", event.event_id),
            ("webhook-timestamp", str(timestamp)),
            ("webhook-signature", signature_header(keys, event.event_id, timestamp, body)),
        ]
        try:
            parsed = parse_url(url, self._policy.allowed_hosts)
            addresses = await vetted_addresses(parsed, self._policy, self._resolve)
        except ValidationFailed as error:
            return _Outcome(None, f"refused: {error.message}")
        except OSError as error:
            return _Outcome(None, f"resolve failed: {_describe(error)}")
        try:
            return _Outcome(await self._send(addresses, parsed, headers, body, self._policy), None)
        except DeliveryFailed as error:
            return _Outcome(None, str(error))

    def body(self, event: ClaimedEvent, tx: Transaction) -> bytes:
        """The event's JSON: rendered at each attempt, so its proof URLs are fresh whenever it arrives."""
        data = {
            "reference_id": tx.reference_id,
            "client_reference": tx.client_reference or "",
            "transaction_type": tx.kind.value,
            "state": tx.state.value,
            "result": self._render(tx),
        }
        payload = event_payload(
            event.event_id, EventType.of_state(event.state), iso_ms(event.final_at_ms), data
        )
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()

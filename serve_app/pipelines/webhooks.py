"""Webhook endpoints and the delivery of completion events (docs/api.md, "Webhooks").

WebhookService is what the API and the CLI call: register (the URL put in its ASCII form and vetted
against the address rules before it is stored), rotate the secret, read the delivery log, redeliver.

WebhookDeliverer is the loop each worker replica runs beside its transaction consumer: it claims due
events from the webhook store with a lease, renders each from the transaction as /result would answer it,
signs it and POSTs it (httpx) to the address its host resolved to and that passed the rules (pinned: no
second lookup). A 2xx answer delivers; anything else (another status, a refusal, a timeout, a connection
error, a name that does not resolve in time, any exception at all in the attempt) is a failed attempt: it
is logged, written to the delivery log and retried with exponential backoff and full jitter until
give_up_after_s has passed since the event was queued, then the event is dead. A worker that dies
mid-delivery settles nothing: the event is due again when its lease runs out, so it is delivered at least
once. Nothing here runs in a transaction's path, and name resolution runs in a thread pool of its own
(SystemResolver), never in the one inference and decoding share.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx

from serve_app.domain.errors import BackendUnavailable, NotFound, ValidationFailed
from serve_app.domain.transactions import Transaction
from serve_app.domain.webhooks import (
    ClaimedEvent,
    DeliveryAttempt,
    EventType,
    IPAddress,
    QueueStats,
    SecretUnreadable,
    Settlement,
    WebhookConfig,
    WebhookUrl,
    ascii_host,
    event_payload,
    literal_address,
    parse_url,
    retry_delay_s,
    signature_header,
    vet_addresses,
)
from serve_app.stores.interfaces import WebhookStore

logger = logging.getLogger(__name__)

USER_AGENT = "facesearch-webhooks/1"


@dataclass(frozen=True)
class WebhookPolicy:
    allowed_hosts: frozenset[str] = frozenset()
    connect_timeout_s: float = 5.0  # also bounds resolving the host's name
    read_timeout_s: float = 10.0
    total_timeout_s: float = 15.0  # the whole attempt: resolving, connecting, sending, the answer's head
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
        # Compared with a URL's host in its ASCII form (an operator may write an IDN as it reads).
        object.__setattr__(self, "allowed_hosts", frozenset(map(_allowed_host, self.allowed_hosts)))


def _allowed_host(host: str) -> str:
    try:
        return ascii_host(host)
    except ValueError:
        return host.lower()  # matches no URL's host: parse_url refuses such a host


class Resolve(Protocol):
    async def __call__(self, host: str, port: int) -> list[str]: ...


class Send(Protocol):
    async def __call__(
        self, addresses: list[IPAddress], url: WebhookUrl, headers: list[tuple[str, str]], body: bytes,
        policy: WebhookPolicy,
    ) -> int: ...  # fmt: skip


class SystemResolver:
    """Every address a host resolves to, by the system's resolver (getaddrinfo) in the thread pool it is
    given: the wiring builds one, bounded, for webhooks alone, so a name server that hangs holds at most
    that pool's threads and never those of asyncio's default executor, where inference, image decoding
    and blob I/O run. getaddrinfo cannot be interrupted: an attempt gives up waiting after its timeout
    (vetted_addresses), while the thread stays until the system resolver gives up itself."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor

    async def __call__(self, host: str, port: int) -> list[str]:
        lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        infos = await asyncio.get_running_loop().run_in_executor(self._executor, lookup)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


class DeliveryFailed(Exception):
    """An attempt that got no status: no address in time, no connection, a timeout, a broken answer."""


class PinnedSender:
    """Send: POSTs with httpx to the first of the vetted addresses that accepts a connection, naming the
    URL's host in Host and in TLS (httpx's sni_hostname extension: SNI and the certificate check), so
    the name is never looked up again. Returns the status code; reads the answer's status line and headers
    and never its body. A head longer than max_response_bytes fails the attempt (httpx's HTTP/1.1 parser
    holds at most 100 KiB of a head it is still reading, whatever the cap). Redirects are not followed: a
    3xx is a failed attempt like any non-2xx.

    Each attempt has a connection of its own (Connection: close, nothing kept alive), so a connection is
    only ever used for the host it was opened for, whatever other host shares its address. The client
    ignores the environment's proxy settings, which would connect elsewhere than the vetted address.
    Certificates are checked against the system's trust store, loaded once here.

    httpx costs more CPU than the hand-written HTTP/1.1 client it replaced: about 2 ms of the worker's CPU
    per delivered event against 1 ms (docs/api.md, "What it costs the worker"), off the transactions'
    path; what it brings is a maintained HTTP/1.1 parser and TLS handling."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        tls = tls if tls is not None else ssl.create_default_context()
        # Nothing is kept alive (and every request says Connection: close): a connection serves one
        # request, so it is never reused for another host that shares its address.
        transport = httpx.AsyncHTTPTransport(
            verify=tls, retries=0, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False, trust_env=False)

    async def __call__(
        self, addresses: list[IPAddress], url: WebhookUrl, headers: list[tuple[str, str]], body: bytes,
        policy: WebhookPolicy,
    ) -> int:  # fmt: skip
        request_headers = [
            ("Host", url.host_header),
            ("User-Agent", USER_AGENT),
            ("Content-Type", "application/json"),
            ("Connection", "close"),
            *headers,
        ]
        timeout = httpx.Timeout(
            connect=policy.connect_timeout_s,
            read=policy.read_timeout_s,
            write=policy.read_timeout_s,
            pool=policy.connect_timeout_s,
        )
        scheme = "https" if url.https else "http"
        extensions = {"sni_hostname": url.host} if url.https else {}
        last_error: Exception | None = None
        for address in addresses:
            literal = f"[{address}]" if address.version == 6 else str(address)
            try:
                async with self._client.stream(
                    "POST",
                    f"{scheme}://{literal}:{url.port}{url.target}",
                    content=body,
                    headers=request_headers,
                    timeout=timeout,
                    extensions=extensions,
                ) as response:
                    if _head_size(response) > policy.max_response_bytes:
                        raise DeliveryFailed("the answer's head is longer than the response cap")
                    return response.status_code
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                last_error = error  # the next address, if any
            except httpx.TimeoutException:
                raise DeliveryFailed("timed out waiting for the answer") from None
            except httpx.HTTPError as error:
                raise DeliveryFailed(_describe(error)) from None
        raise DeliveryFailed(f"connect failed: {_describe(last_error)}")


def _head_size(response: httpx.Response) -> int:
    """The bytes of the answer's status line and headers, as they came."""
    status = len(response.http_version) + len(response.reason_phrase) + 7  # "<version> 200 <reason>\r\n"
    return status + sum(len(name) + len(value) + 4 for name, value in response.headers.raw) + 2


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "no address"
    if isinstance(error, TimeoutError | httpx.ConnectTimeout):
        return "connect timed out"
    return f"{type(error).__name__}: {error}"[:200]


async def vetted_addresses(url: WebhookUrl, policy: WebhookPolicy, resolve: Resolve) -> list[IPAddress]:
    """The addresses a delivery may connect to, resolved once; ValidationFailed if any is refused,
    DeliveryFailed if the name does not resolve within connect_timeout_s. A host the operator allows is
    resolved too (and pinned) but not vetted."""
    literal = literal_address(url.host)
    found = [str(literal)] if literal is not None else await _resolve(url, policy, resolve)
    if url.host in policy.allowed_hosts:
        if not found:
            raise ValidationFailed(f"{url.host} does not resolve.", {"url": "host does not resolve"})
        return [literal_address(text.split("%", 1)[0]) or _never(text) for text in found]
    return vet_addresses(url.host, found)


async def _resolve(url: WebhookUrl, policy: WebhookPolicy, resolve: Resolve) -> list[str]:
    try:
        async with asyncio.timeout(policy.connect_timeout_s):
            return await resolve(url.host, url.port)
    except TimeoutError:
        raise DeliveryFailed(f"resolving {url.host} timed out after {policy.connect_timeout_s:g} s") from None
    except (OSError, UnicodeError) as error:  # getaddrinfo's failures (socket.gaierror; a bad name)
        raise DeliveryFailed(f"resolving {url.host} failed: {_describe(error)}") from None


def _never(text: str) -> IPAddress:
    raise ValidationFailed(f"{text} is not an address.", {"url": "unresolvable"})


@dataclass(frozen=True)
class Registration:
    config: WebhookConfig
    secret: str | None  # shown once: when this call created it


class WebhookService:
    """The client's and the operator's side: registration with the address rules, the secret, the log."""

    def __init__(self, store: WebhookStore, policy: WebhookPolicy, resolve: Resolve):
        """resolve: the host names' resolver (SystemResolver on a pool of its own, from the wiring)."""
        self._store = store
        self._policy = policy
        self._resolve = resolve

    async def check_url(self, url: str) -> WebhookUrl:
        """The URL in its ASCII form (parse_url), once its host resolves to addresses the rules allow;
        ValidationFailed otherwise."""
        parsed = parse_url(url, self._policy.allowed_hosts)
        try:
            await vetted_addresses(parsed, self._policy, self._resolve)
        except DeliveryFailed as error:
            raise ValidationFailed(
                f"The webhook URL is refused: its host does not resolve ({error}).",
                {"url": "host does not resolve"},
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
        store: WebhookStore,
        load: LoadTransaction,
        render: RenderResult,
        policy: WebhookPolicy,
        *,
        resolve: Resolve,
        send: Send | None = None,
        on_outcome: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        """load(tenant, reference_id): the transaction as its owner reads it (None: gone). render(tx):
        the body /result answers for it (serve_app/api/results.py renders both). resolve: the host
        names' resolver (SystemResolver on a pool of its own, from the wiring). send: PinnedSender by
        default. on_outcome: called with delivered, retried or dead after each settled attempt (the
        metrics)."""
        self._store = store
        self._load = load
        self._render = render
        self._policy = policy
        self._resolve = resolve
        self._send: Send = send if send is not None else PinnedSender()
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
                # The attempt could not be recorded (the store is away): the lease lapses and the event is
                # due again, and is then settled like any other (dead once its window has passed).
                logger.warning("webhook event %s not settled: %r", event.event_id, result)
        return len(events)

    async def _deliver(self, event: ClaimedEvent) -> None:
        started = time.perf_counter()
        self.attempts += 1
        try:
            outcome = await self._attempt(event)
        except Exception as error:  # whatever it is, the attempt failed: it counts, and is retried
            logger.exception("webhook event %s: attempt %d raised", event.event_id, event.attempt)
            outcome = _Outcome(None, f"internal error: {_describe(error)}")
        duration_ms = (time.perf_counter() - started) * 1000
        now = self._clock()
        delivered = outcome.status is not None and 200 <= outcome.status < 300
        give_up_at = event.since_ms / 1000 + self._policy.give_up_after_s
        next_due = None
        if delivered:
            kind, words = Settlement.DELIVERED, "delivered"
        elif outcome.permanent or now >= give_up_at:
            kind, words = Settlement.DEAD, "dead"
        else:
            delay = retry_delay_s(
                event.attempt, self._policy.retry_base_s, self._policy.retry_max_delay_s, self._rng
            )
            # Never past the give-up time: the last retry comes at the end of the window, not after it.
            next_due = min(now + delay, give_up_at)
            kind, words = Settlement.RETRY, "retrying"
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
        if not delivered:
            log = logger.warning if kind is Settlement.DEAD else logger.info
            log(
                "webhook event %s of %s, attempt %d: %s; %s",
                event.event_id,
                event.tenant,
                event.attempt,
                record.in_words,
                "dead" if next_due is None else f"next attempt in {next_due - now:.1f} s",
            )
        if await self._store.settle(event, kind, record, next_due):
            self._on_outcome({Settlement.RETRY: "retried"}.get(kind, kind.value))

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
            # A URL stored before URLs were kept in their ASCII form is put in it here.
            parsed = parse_url(url, self._policy.allowed_hosts)
            async with asyncio.timeout(self._policy.total_timeout_s):
                addresses = await vetted_addresses(parsed, self._policy, self._resolve)
                return _Outcome(await self._send(addresses, parsed, headers, body, self._policy), None)
        except ValidationFailed as error:
            return _Outcome(None, f"refused: {error.message}")
        except DeliveryFailed as error:
            return _Outcome(None, str(error))
        except TimeoutError:
            return _Outcome(None, f"timed out after {self._policy.total_timeout_s:g} s")

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

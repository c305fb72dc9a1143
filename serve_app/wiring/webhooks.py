"""Webhooks' object graph from Settings: the store (secrets sealed under the key ring's webhook key), the
service the API and the CLI use, and the worker's delivery loop, which renders each event's result with
the function /result answers with (serve_app/api/results.py). Each of the two resolves host names in a
thread pool of its own (webhook_resolver), never in asyncio's default one, which inference, decoding and
blob I/O share: a webhook's name server that hangs cannot hold their threads."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from redis.asyncio import Redis

from serve_app.api.results import result_response
from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import ValidationFailed
from serve_app.domain.keys import WEBHOOK_SECRETS
from serve_app.domain.transactions import Transaction
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.webhooks import (
    PinnedSender,
    SystemResolver,
    WebhookDeliverer,
    WebhookPolicy,
    WebhookService,
)
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import FaceRecordStore, ResultArchive, TransactionStore
from serve_app.stores.redis_webhooks import RedisWebhookStore, SecretCipher


def webhook_policy(settings: Settings) -> WebhookPolicy:
    hooks = settings.webhooks
    return WebhookPolicy(
        allowed_hosts=frozenset(hooks.allowed_hosts),
        connect_timeout_s=hooks.connect_timeout_s,
        read_timeout_s=hooks.read_timeout_s,
        total_timeout_s=hooks.total_timeout_s,
        max_response_bytes=hooks.max_response_bytes,
        retry_base_s=hooks.retry_base_s,
        retry_max_delay_s=hooks.retry_max_delay_s,
        give_up_after_s=hooks.give_up_after_s,
        lease_s=hooks.lease_s,
        batch=hooks.batch,
        secret_grace_s=hooks.secret_grace_s,
    )


def webhook_store(settings: Settings, redis: Redis) -> RedisWebhookStore:
    return RedisWebhookStore(
        redis,
        SecretCipher(settings.auth.key_ring().for_purpose(WEBHOOK_SECRETS)),
        prefix=settings.redis.key_prefix,
        log_size=settings.webhooks.log_size,
        event_retention_s=settings.webhooks.event_retention_s,
    )


# Registrations resolve one name each, on the API's few concurrent requests that register a webhook.
REGISTRATION_RESOLVER_THREADS = 4


def webhook_resolver(threads: int, name: str) -> SystemResolver:
    """getaddrinfo on a pool of at most `threads` threads of its own. Owned by the deliverer or service it
    is given to, for the life of the process (threads start only when needed)."""
    return SystemResolver(ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name))


def webhook_service(settings: Settings, redis: Redis) -> WebhookService:
    resolver = webhook_resolver(REGISTRATION_RESOLVER_THREADS, "webhook-dns-register")
    return WebhookService(webhook_store(settings, redis), webhook_policy(settings), resolver)


def result_renderer(settings: Settings) -> Callable[[Transaction], dict[str, Any]]:
    """The body POST /result answers for a final transaction, as a dict. Proof URLs are absolute with
    FACESEARCH_PUBLIC_BASE_URL, else paths (/get-proof/...) on the service's own address."""
    signer = TokenSigner(
        settings.auth.key_ring(), settings.auth.access_token_ttl_s, settings.auth.proof_ttl_s
    )
    base = settings.http.public_base_url or ""

    def render(tx: Transaction) -> dict[str, Any]:
        body: dict[str, Any] = orjson.loads(result_response(tx, base, signer, created=False).body)
        return body

    return render


def build_deliverer(
    settings: Settings,
    redis: Redis,
    transactions: TransactionStore,
    records: FaceRecordStore,
    archive: ResultArchive,
    on_outcome: Callable[[str], None] | None = None,
) -> WebhookDeliverer:
    """The delivery loop of a worker replica, on its stores. Transactions are read as /result reads them:
    Redis, then the result archive, with the matches' client references joined now."""
    service = TransactionService(
        transactions,
        LocalBlobStore(settings.blobs),
        settings.limits.max_image_pixels,
        records=records,
        archive=archive,
    )

    async def load(tenant: str, reference_id: str) -> Transaction | None:
        try:
            return await service.readable(await service.get_for_tenant(tenant, reference_id))
        except ValidationFailed:
            return None

    return WebhookDeliverer(
        webhook_store(settings, redis),
        load,
        result_renderer(settings),
        webhook_policy(settings),
        # One thread per event attempted at once: a batch never waits for a thread unless resolutions
        # hang, and then only its own (each attempt gives up after its timeout).
        resolve=webhook_resolver(settings.webhooks.batch, "webhook-dns"),
        send=PinnedSender(),
        on_outcome=on_outcome,
    )

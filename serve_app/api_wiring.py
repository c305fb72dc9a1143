"""The ingress' object graph (stores and API services) from Settings. Kept apart from serve_app.wiring, which
builds the worker's processor and with it the model-side imports: the ingress must not load model libraries
(tests/unit/test_ingress_imports.py)."""

from __future__ import annotations

from dataclasses import dataclass

from models.types import FUSED_DIM, MODEL_VERSION
from serve_app.api.app import ApiServices
from serve_app.api.limits import parse_networks
from serve_app.api.tokens import TokenSigner
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.settings import Settings, wait_replicas
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_lease import RedisLeases
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.result_archive import BlobResultArchive


@dataclass(frozen=True)
class RedisStores:
    transactions: RedisTransactionStore
    records: RedisFaceRecordStore
    clients: RedisClientStore
    limiter: RedisRateLimiter
    admission: RedisRequestAdmission
    audit: RedisAuditLog


def require(value: str | None, name: str) -> str:
    if not value:
        raise RuntimeError(
            f"{name} is not resolved; the graph builder must start or locate the backend first"
        )
    return value


def redis_stores(settings: Settings) -> RedisStores:
    redis = connect_redis(require(settings.redis.url, "REDIS_URL"), max_connections=settings.redis.pool_size)
    prefix = settings.redis.key_prefix
    retention = settings.retention
    return RedisStores(
        transactions=RedisTransactionStore(
            redis,
            prefix=prefix,
            finished_ttl_s=retention.transaction_retention_s or None,
            done_signal_ttl_s=retention.done_signal_ttl_s,
            replicas=wait_replicas(settings),
            replica_timeout_ms=settings.redis.wait_timeout_ms,
            archive_after_s=retention.archive_after_s,
        ),
        records=RedisFaceRecordStore(redis, prefix=prefix, erasure_ttl_s=retention.erasure_memory_s),
        clients=RedisClientStore(redis, pepper=settings.auth.secret_key, prefix=prefix),
        limiter=RedisRateLimiter(redis, prefix=prefix),
        admission=RedisRequestAdmission(redis, prefix=prefix),
        audit=RedisAuditLog(redis, prefix=prefix),
    )


def gallery_store(settings: Settings) -> MilvusGalleryStore:
    milvus = settings.milvus
    return MilvusGalleryStore(
        require(milvus.uri, "MILVUS_URI"),
        token=milvus.token,
        model_version=MODEL_VERSION,
        dimension=FUSED_DIM,
        timeout_s=milvus.timeout_s,
        index_policy=IndexPolicy(
            flat_max_rows=milvus.flat_max_rows,
            large_index=milvus.large_index,
            build_params=dict(milvus.index_params),
            search_params=dict(milvus.search_params),
        ),
        consistency_level=milvus.consistency_level,
        # Its own small client: the lease is taken once per index switch, rarely.
        switch_leases=RedisLeases(
            connect_redis(require(settings.redis.url, "REDIS_URL"), max_connections=2),
            prefix=settings.redis.key_prefix,
        ),
        switch_timeout_s=milvus.index_switch_timeout_s,
    )


def result_archive(settings: Settings) -> BlobResultArchive:
    """Always there to read: results archived earlier stay readable if the hot window is later turned off."""
    return BlobResultArchive(LocalBlobStore(settings.results), settings.retention.transaction_retention_s)


def build_api_services(settings: Settings) -> ApiServices:
    stores = redis_stores(settings)
    blobs = LocalBlobStore(settings.blobs)
    return ApiServices(
        transactions=TransactionService(
            stores.transactions,
            blobs,
            settings.limits.max_image_pixels,
            records=stores.records,
            archive=result_archive(settings),
        ),
        proofs=ProofService(stores.records, blobs),
        auth=ClientAuthenticator(
            stores.clients,
            stores.limiter,
            stores.admission,
            login_failures_per_window=settings.auth.login_failures_per_window,
            login_window_s=settings.auth.login_window_s,
            requests_per_minute=settings.limits.requests_per_minute,
            login_backoff_max_s=settings.auth.login_backoff_max_s,
            unauthenticated_per_minute=settings.limits.unauthenticated_per_minute,
        ),
        signer=TokenSigner(
            settings.auth.secret_key,
            settings.auth.access_token_ttl_s,
            settings.auth.proof_ttl_s,
            verified_cache_size=settings.auth.verified_token_cache,
        ),
        max_upload_bytes=settings.limits.max_upload_bytes,
        wait_for_result_timeout_s=settings.limits.wait_for_result_timeout_s,
        public_base_url=settings.http.public_base_url,
        trusted_proxies=parse_networks(settings.http.trusted_proxies),
        # Gallery management needs Milvus (removals); an API built on Redis alone (the edge tests) has none.
        gallery=GalleryService(
            stores.records,
            gallery_store(settings),  # connects to Milvus lazily, on the first gallery removal
            blobs,
            stores.audit,
            subject_key=settings.auth.secret_key.encode(),
            model_version=MODEL_VERSION,
        )
        if settings.milvus.uri
        else None,
    )

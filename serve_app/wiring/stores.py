"""The stores of one process from Settings, each built once: one Redis connection pool serves every Redis
store of the process (and the index switch's leases), and one Milvus client the gallery. Used by the ingress
(serve_app.wiring.api), the worker (serve_app.wiring.worker), the CLI and the tests, so each gets the same
stores configured the same way. No model library is imported here: the ingress must not load one
(tests/unit/test_ingress_imports.py)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from serve_app.domain.keys import CLIENT_SECRETS
from serve_app.settings import Settings, wait_replicas
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import LockPolicy
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_lease import RedisLeases
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_tenant_clock import RedisTenantClock
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.result_archive import BlobResultArchive
from serve_app.wiring.models import serving_face_model


@dataclass(frozen=True)
class RedisStores:
    """The Redis stores of one process, all on one connection pool (`redis`)."""

    redis: Redis
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


def connect(settings: Settings) -> Redis:
    """The process' Redis connection pool."""
    return connect_redis(require(settings.redis.url, "REDIS_URL"), max_connections=settings.redis.pool_size)


def redis_stores(settings: Settings, redis: Redis | None = None) -> RedisStores:
    """The Redis stores on `redis` (default: a new pool; a process builds them once and passes them on)."""
    redis = redis if redis is not None else connect(settings)
    prefix = settings.redis.key_prefix
    retention = settings.retention
    return RedisStores(
        redis=redis,
        transactions=RedisTransactionStore(
            redis,
            prefix=prefix,
            finished_ttl_s=retention.transaction_retention_s or None,
            done_signal_ttl_s=retention.done_signal_ttl_s,
            replicas=wait_replicas(settings),
            replica_timeout_ms=settings.redis.wait_timeout_ms,
            archive_after_s=retention.archive_after_s,
            idempotency_ttl_s=retention.idempotency_key_ttl_s,
        ),
        records=RedisFaceRecordStore(redis, prefix=prefix, erasure_ttl_s=retention.erasure_memory_s),
        clients=RedisClientStore(
            redis, pepper=settings.auth.key_ring().for_purpose(CLIENT_SECRETS), prefix=prefix
        ),
        limiter=RedisRateLimiter(redis, prefix=prefix),
        admission=RedisRequestAdmission(redis, prefix=prefix),
        audit=RedisAuditLog(redis, prefix=prefix, retention_s=retention.audit_retention_s or None),
    )


def lock_policy(settings: Settings) -> LockPolicy:
    """The lock of a face's client_reference, as every process takes it (pipelines/lifecycle.py)."""
    redis = settings.redis
    return LockPolicy(wait_s=redis.lock_wait_s, ttl_s=redis.lock_ttl_s, max_hold_s=redis.lock_max_hold_s)


def gallery_store(settings: Settings, redis: Redis | None = None) -> MilvusGalleryStore:
    """The gallery (its Milvus client connects lazily, on first use). redis: the process' pool, for the
    index switch's lease (taken once per switch, rarely) and the tenants' write clock (read by every
    search); default: a small client of its own."""
    milvus = settings.milvus
    if redis is None:
        redis = connect_redis(require(settings.redis.url, "REDIS_URL"), max_connections=4)
    face_model = serving_face_model(settings)
    return MilvusGalleryStore(
        require(milvus.uri, "MILVUS_URI"),
        token=milvus.token,
        model_version=face_model.version,
        dimension=face_model.dim,
        timeout_s=milvus.timeout_s,
        index_policy=IndexPolicy(
            flat_max_rows=milvus.flat_max_rows,
            large_index=milvus.large_index,
            build_params=dict(milvus.index_params),
            search_params=dict(milvus.search_params),
        ),
        consistency_level=milvus.consistency_level,
        switch_leases=RedisLeases(redis, prefix=settings.redis.key_prefix),
        switch_timeout_s=milvus.index_switch_timeout_s,
        write_clock=RedisTenantClock(redis, prefix=settings.redis.key_prefix),
    )


def result_archive(settings: Settings) -> BlobResultArchive:
    """Always there to read: results archived earlier stay readable if the hot window is later turned off."""
    return BlobResultArchive(LocalBlobStore(settings.results), settings.retention.transaction_retention_s)

"""The stores of one process from Settings, each built once: one Redis connection pool serves every Redis
store of the process (and the background jobs' leases), and one Milvus client the gallery. Used by the
ingress (serve_app.wiring.api), the worker (serve_app.wiring.worker), the CLI and the tests, so each gets the
same stores configured the same way. No model library is imported here: the ingress must not load one
(tests/unit/test_ingress_imports.py).

Thread pools (ThreadPools): the stores' blocking calls run in bounded pools of their own, apart from the
event loop's default pool, which decodes images and runs the models. Milvus calls have one (a server that
hangs holds its threads only: a transaction that needs no Milvus goes on decoding and estimating), blob
I/O another (on a cluster the blob and result directories are a shared volume, NFS or the like, which can
hang as a server can), and the long jobs a third (the index switch's steps, the walks of the blob and
result directories: one that runs for minutes, or hangs on a file, never holds a thread the transactions
need). A process builds its pools once and shuts them down when it stops."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis

from serve_app.domain.keys import CLIENT_SECRETS
from serve_app.settings import MilvusSettings, Settings, wait_replicas
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import LockPolicy
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_admission import RedisRequestAdmission
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_tenant_clock import RedisTenantClock
from serve_app.stores.redis_transactions import RedisTransactionStore
from serve_app.stores.result_archive import BlobResultArchive
from serve_app.wiring.models import serving_face_model


@dataclass(frozen=True)
class ThreadPools:
    """A process' bounded thread pools (the module docstring), sized by Settings.threads."""

    milvus: ThreadPoolExecutor
    blobs: ThreadPoolExecutor
    jobs: ThreadPoolExecutor

    @classmethod
    def build(cls, settings: Settings) -> ThreadPools:
        threads = settings.threads
        return cls(
            milvus=ThreadPoolExecutor(threads.milvus, thread_name_prefix="milvus"),
            blobs=ThreadPoolExecutor(threads.blobs, thread_name_prefix="blobs"),
            jobs=ThreadPoolExecutor(threads.jobs, thread_name_prefix="jobs"),
        )

    def shutdown(self) -> None:
        """Calls not yet started are dropped; a thread that hangs in a call is left to end with the
        process (a thread cannot be stopped), never waited for."""
        for pool in (self.milvus, self.blobs, self.jobs):
            pool.shutdown(wait=False, cancel_futures=True)


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


def index_policy(milvus: MilvusSettings) -> IndexPolicy:
    """The gallery's index rule (exact up to a size, then the large index) from the settings."""
    return IndexPolicy(
        flat_max_rows=milvus.flat_max_rows,
        large_index=milvus.large_index,
        build_params=dict(milvus.index_params),
        search_params=dict(milvus.search_params),
    )


def gallery_store(
    settings: Settings, redis: Redis | None = None, pools: ThreadPools | None = None
) -> MilvusGalleryStore:
    """The gallery (its Milvus client connects lazily, on first use). redis: the process' pool, for the
    tenants' write clock (read by every search); default: a small client of its own. pools: the process'
    thread pools (None: the event loop's default pool, for a command that runs a few calls)."""
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
        index_policy=index_policy(milvus),
        consistency_level=milvus.consistency_level,
        switch_timeout_s=milvus.index_switch_timeout_s,
        write_clock=RedisTenantClock(redis, prefix=settings.redis.key_prefix),
        executor=pools.milvus if pools is not None else None,
        job_executor=pools.jobs if pools is not None else None,
    )


def blob_store(directory: Path, pools: ThreadPools | None = None) -> LocalBlobStore:
    """A blob directory (uploads and proofs, or the result archive's) on the process' pools."""
    if pools is None:
        return LocalBlobStore(directory)
    return LocalBlobStore(directory, io=pools.blobs, scans=pools.jobs)


def result_archive(settings: Settings, pools: ThreadPools | None = None) -> BlobResultArchive:
    """Always there to read: results archived earlier stay readable if the hot window is later turned off."""
    return BlobResultArchive(blob_store(settings.results, pools), settings.retention.transaction_retention_s)

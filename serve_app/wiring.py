"""Builds the object graph of one process (stores, services) from Settings. Used by the deployments, the CLI
and the tests, so each gets the same stores configured the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.calibration import FaceScoreCalibration
from models.embedder import FUSED_DIM, MODEL_VERSION
from serve_app.api.app import ApiServices
from serve_app.api.limits import parse_networks
from serve_app.api.tokens import TokenSigner
from serve_app.pipelines.analysis import DeadlineAnalysis, FaceAnalysisBackend
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import Settings, wait_replicas
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import IndexPolicy, MilvusGalleryStore
from serve_app.stores.redis_audit import RedisAuditLog
from serve_app.stores.redis_clients import RedisClientStore
from serve_app.stores.redis_ratelimit import RedisRateLimiter
from serve_app.stores.redis_records import RedisFaceRecordStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.redis_transactions import RedisTransactionStore


@dataclass(frozen=True)
class RedisStores:
    transactions: RedisTransactionStore
    records: RedisFaceRecordStore
    clients: RedisClientStore
    limiter: RedisRateLimiter
    audit: RedisAuditLog


def _require(value: str | None, name: str) -> str:
    if not value:
        raise RuntimeError(
            f"{name} is not resolved; the graph builder must start or locate the backend first"
        )
    return value


def redis_stores(settings: Settings) -> RedisStores:
    # Every wait_for_result waiter holds a connection (BLPOP): size the pool well above max_ongoing_requests.
    redis = connect_redis(_require(settings.redis_url, "REDIS_URL"), max_connections=1024)
    prefix = settings.key_prefix
    return RedisStores(
        transactions=RedisTransactionStore(
            redis,
            prefix=prefix,
            finished_ttl_s=settings.transaction_retention_s or None,
            replicas=wait_replicas(settings),
            replica_timeout_ms=settings.redis_wait_timeout_ms,
        ),
        records=RedisFaceRecordStore(redis, prefix=prefix),
        clients=RedisClientStore(redis, pepper=settings.secret_key, prefix=prefix),
        limiter=RedisRateLimiter(redis, prefix=prefix),
        audit=RedisAuditLog(redis, prefix=prefix),
    )


def gallery_store(settings: Settings) -> MilvusGalleryStore:
    return MilvusGalleryStore(
        _require(settings.milvus_uri, "MILVUS_URI"),
        token=settings.milvus_token,
        model_version=MODEL_VERSION,
        dimension=FUSED_DIM,
        index_policy=IndexPolicy(
            flat_max_rows=settings.milvus_flat_max_rows,
            large_index=settings.milvus_large_index,
            build_params=settings.milvus_index_params,
            search_params=settings.milvus_search_params,
        ),
    )


def build_api_services(settings: Settings) -> ApiServices:
    stores = redis_stores(settings)
    blobs = LocalBlobStore(settings.blob_dir)
    return ApiServices(
        transactions=TransactionService(stores.transactions, blobs, settings.max_image_pixels),
        proofs=ProofService(stores.records, blobs),
        auth=ClientAuthenticator(
            stores.clients,
            stores.limiter,
            login_failures_per_window=settings.login_failures_per_window,
            login_window_s=settings.login_window_s,
            requests_per_minute=settings.requests_per_minute,
            login_backoff_max_s=settings.login_backoff_max_s,
            unauthenticated_per_minute=settings.unauthenticated_per_minute,
        ),
        signer=TokenSigner(settings.secret_key, settings.access_token_ttl_s, settings.proof_ttl_s),
        max_upload_bytes=settings.max_upload_bytes,
        wait_for_result_timeout_s=settings.wait_for_result_timeout_s,
        public_base_url=settings.public_base_url,
        trusted_proxies=parse_networks(settings.trusted_proxies),
        gallery=GalleryService(
            stores.records,
            gallery_store(settings),  # connects to Milvus lazily, on the first gallery removal
            blobs,
            stores.audit,
            subject_key=settings.secret_key.encode(),
            model_version=MODEL_VERSION,
        ),
    )


def build_processor(settings: Settings, analysis: FaceAnalysisBackend) -> TransactionProcessor:
    stores = redis_stores(settings)
    policy = ProcessingPolicy(
        model_version=MODEL_VERSION,
        max_matches=settings.max_matches,
        min_score=settings.match_min_score,
        max_image_pixels=settings.max_image_pixels,
        analysis_max_side=settings.analysis_max_side,
        calibration=FaceScoreCalibration.load(),
    )
    return TransactionProcessor(
        stores.transactions,
        stores.records,
        gallery_store(settings),
        LocalBlobStore(settings.blob_dir),
        DeadlineAnalysis(analysis, settings.model_call_timeout_s),
        policy,
        clients=stores.clients,
    )


def worker_policy(settings: Settings, overrides: dict[str, Any]) -> WorkerPolicy:
    return WorkerPolicy(
        concurrency=int(overrides.get("concurrency", settings.worker_concurrency)),
        stale_after_s=float(overrides.get("stale_after_s", settings.stale_after_s)),
        max_deliveries=int(overrides.get("max_deliveries", settings.max_deliveries)),
    )


def build_worker(
    settings: Settings,
    analysis: FaceAnalysisBackend,
    consumer: str,
    on_processed: Callable[[float], None] | None = None,
) -> tuple[QueueWorker, RedisStores]:
    stores = redis_stores(settings)
    processor = build_processor(settings, analysis)
    policy = worker_policy(settings, {})
    worker = QueueWorker(consumer, stores.transactions, processor, policy, on_processed)
    return worker, stores

"""Builds the object graph of one process (stores, services) from Settings. Used by the deployments, the CLI
and the tests, so each gets the same stores configured the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from models.calibration import FaceScoreCalibration
from models.embedder import FUSED_DIM, MODEL_VERSION
from serve_app.api.app import ApiServices
from serve_app.api.limits import parse_networks
from serve_app.api.tokens import TokenSigner
from serve_app.deploy_config import WorkerConfig
from serve_app.pipelines.analysis import DeadlineAnalysis, FaceAnalysisBackend
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
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


def _require(value: str | None, name: str) -> str:
    if not value:
        raise RuntimeError(
            f"{name} is not resolved; the graph builder must start or locate the backend first"
        )
    return value


def redis_stores(settings: Settings) -> RedisStores:
    redis = connect_redis(_require(settings.redis.url, "REDIS_URL"), max_connections=settings.redis.pool_size)
    prefix = settings.redis.key_prefix
    retention = settings.retention
    return RedisStores(
        transactions=RedisTransactionStore(
            redis,
            prefix=prefix,
            finished_ttl_s=retention.transaction_retention_s or None,
            done_signal_ttl_s=retention.done_signal_ttl_s,
        ),
        records=RedisFaceRecordStore(redis, prefix=prefix),
        clients=RedisClientStore(redis, pepper=settings.auth.secret_key, prefix=prefix),
        limiter=RedisRateLimiter(redis, prefix=prefix),
    )


def gallery_store(settings: Settings) -> MilvusGalleryStore:
    return MilvusGalleryStore(
        _require(settings.milvus.uri, "MILVUS_URI"),
        token=settings.milvus.token,
        model_version=MODEL_VERSION,
        dimension=FUSED_DIM,
        timeout_s=settings.milvus.timeout_s,
    )


def build_api_services(settings: Settings) -> ApiServices:
    stores = redis_stores(settings)
    blobs = LocalBlobStore(settings.blobs)
    return ApiServices(
        transactions=TransactionService(stores.transactions, blobs, settings.limits.max_image_pixels),
        proofs=ProofService(stores.records, blobs),
        auth=ClientAuthenticator(
            stores.clients,
            stores.limiter,
            login_failures_per_window=settings.auth.login_failures_per_window,
            login_window_s=settings.auth.login_window_s,
            requests_per_minute=settings.limits.requests_per_minute,
            login_backoff_max_s=settings.auth.login_backoff_max_s,
            unauthenticated_per_minute=settings.limits.unauthenticated_per_minute,
        ),
        signer=TokenSigner(
            settings.auth.secret_key, settings.auth.access_token_ttl_s, settings.auth.proof_ttl_s
        ),
        max_upload_bytes=settings.limits.max_upload_bytes,
        wait_for_result_timeout_s=settings.limits.wait_for_result_timeout_s,
        public_base_url=settings.http.public_base_url,
        trusted_proxies=parse_networks(settings.http.trusted_proxies),
    )


def build_processor(settings: Settings, analysis: FaceAnalysisBackend) -> TransactionProcessor:
    stores = redis_stores(settings)
    policy = ProcessingPolicy(
        model_version=MODEL_VERSION,
        max_matches=settings.search.max_matches,
        min_score=settings.search.match_min_score,
        max_image_pixels=settings.limits.max_image_pixels,
        analysis_max_side=settings.models.analysis_max_side,
        calibration=FaceScoreCalibration.load(),
    )
    return TransactionProcessor(
        stores.transactions,
        stores.records,
        gallery_store(settings),
        LocalBlobStore(settings.blobs),
        DeadlineAnalysis(analysis, settings.models.model_call_timeout_s),
        policy,
        clients=stores.clients,
    )


def worker_policy(settings: Settings, overrides: WorkerConfig | None = None) -> WorkerPolicy:
    """The worker's policy: Settings.worker, with what the deployment's user_config sets on top."""
    overrides = overrides or WorkerConfig()
    return WorkerPolicy(
        concurrency=overrides.concurrency or settings.worker.concurrency,
        stale_after_s=overrides.stale_after_s or settings.worker.stale_after_s,
        max_deliveries=overrides.max_deliveries or settings.worker.max_deliveries,
    )


def build_worker(
    settings: Settings,
    analysis: FaceAnalysisBackend,
    consumer: str,
    on_processed: Callable[[float], None] | None = None,
) -> tuple[QueueWorker, RedisStores]:
    stores = redis_stores(settings)
    processor = build_processor(settings, analysis)
    policy = worker_policy(settings)
    worker = QueueWorker(consumer, stores.transactions, processor, policy, on_processed)
    return worker, stores

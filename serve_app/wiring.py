"""Builds the object graph of one process (stores, services) from Settings. Used by the deployments, the CLI
and the tests, so each gets the same stores configured the same way. The ingress' part (stores, API
services) lives in serve_app.api_wiring, which loads no model library."""

from __future__ import annotations

from collections.abc import Callable

from models.calibration import FaceScoreCalibration
from models.embedder import MODEL_VERSION
from serve_app.api_wiring import RedisStores as RedisStores
from serve_app.api_wiring import build_api_services as build_api_services
from serve_app.api_wiring import gallery_store as gallery_store
from serve_app.api_wiring import redis_stores as redis_stores
from serve_app.api_wiring import require
from serve_app.api_wiring import result_archive as result_archive
from serve_app.deploy_config import WorkerConfig
from serve_app.pipelines.analysis import DeadlineAnalysis, FaceAnalysisBackend
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.reconcile import ReconcilePolicy, Reconciler
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.interfaces import GalleryStore
from serve_app.stores.redis_reconcile import RedisReconcileState
from serve_app.stores.redis_support import connect_redis


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


def build_reconciler(settings: Settings, holder: str, gallery: GalleryStore | None = None) -> Reconciler:
    """Reconciliation of this process (a worker replica, `facesearch reconcile`); holder names it on the
    cluster-wide lease. gallery: a store the caller already has (default: a new one)."""
    stores = redis_stores(settings)
    worker = settings.worker
    redis = connect_redis(require(settings.redis.url, "REDIS_URL"))
    return Reconciler(
        records=stores.records,
        gallery=gallery if gallery is not None else gallery_store(settings),
        transactions=stores.transactions,
        state=RedisReconcileState(redis, prefix=settings.redis.key_prefix),
        holder=holder,
        policy=ReconcilePolicy(
            grace_s=worker.reconcile_grace_s,
            batch=worker.reconcile_batch,
            lease_s=worker.reconcile_lease_s,
            model_version=MODEL_VERSION,
            orphan_grace_s=settings.retention.orphan_upload_grace_s,
        ),
        blobs=LocalBlobStore(settings.blobs),
    )

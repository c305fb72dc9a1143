"""The worker's object graph from Settings: its stores, built once per process and shared by the queue
worker, reconciliation and the result archive, then the processor and the reconciler on them. Used by the
worker deployment, the CLI (`facesearch reconcile`) and the tests. Loads the models' code (calibration), so
the ingress never imports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from models.age_policy import AgeIntervalRule
from serve_app.pipelines.analysis import DeadlineAnalysis, FaceAnalysisBackend
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.reconcile import ReconcilePolicy, Reconciler
from serve_app.pipelines.score_watch import OutcomeReporting, SearchObserver
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_reconcile import RedisReconcileState
from serve_app.stores.result_archive import BlobResultArchive
from serve_app.wiring.models import score_calibration, serving_face_model
from serve_app.wiring.stores import RedisStores, gallery_store, lock_policy, redis_stores, result_archive


@dataclass(frozen=True)
class WorkerStores:
    """Everything a worker process stores into: one Redis pool (all Redis stores), one Milvus client."""

    redis: RedisStores
    gallery: MilvusGalleryStore
    blobs: LocalBlobStore
    archive: BlobResultArchive

    @classmethod
    def build(cls, settings: Settings) -> WorkerStores:
        redis = redis_stores(settings)
        return cls(
            redis=redis,
            gallery=gallery_store(settings, redis.redis),
            blobs=LocalBlobStore(settings.blobs),
            archive=result_archive(settings),
        )


def build_processor(
    settings: Settings,
    analysis: FaceAnalysisBackend,
    stores: WorkerStores,
    on_search: SearchObserver | None = None,
) -> TransactionProcessor:
    """on_search: told each face search outcome the processor makes final, with its tenant (the score
    metrics)."""
    policy = ProcessingPolicy(
        model_version=serving_face_model(settings).version,
        max_matches=settings.search.max_matches,
        min_score=settings.search.match_min_score,
        max_image_pixels=settings.limits.max_image_pixels,
        analysis_max_side=settings.models.analysis_max_side,
        calibration=score_calibration(settings),
        lock=lock_policy(settings),
        age_rule=AgeIntervalRule.load(minor_cleared_rate=settings.models.age_minor_cleared_rate),
    )
    transactions = stores.redis.transactions
    return TransactionProcessor(
        OutcomeReporting(transactions, on_search) if on_search is not None else transactions,
        stores.redis.records,
        stores.gallery,
        stores.blobs,
        DeadlineAnalysis(analysis, settings.models.model_call_timeout_s),
        policy,
        clients=stores.redis.clients,
    )


def worker_policy(
    settings: Settings,
    *,
    concurrency: int | None = None,
    stale_after_s: float | None = None,
    max_deliveries: int | None = None,
) -> WorkerPolicy:
    """The worker's policy: Settings.worker, with what the deployment's user_config sets on top."""
    return WorkerPolicy(
        concurrency=concurrency or settings.worker.concurrency,
        stale_after_s=stale_after_s or settings.worker.stale_after_s,
        max_deliveries=max_deliveries or settings.worker.max_deliveries,
    )


def build_worker(
    settings: Settings,
    analysis: FaceAnalysisBackend,
    consumer: str,
    on_processed: Callable[[float], None] | None = None,
    stores: WorkerStores | None = None,
    on_search: SearchObserver | None = None,
) -> tuple[QueueWorker, WorkerStores]:
    """The queue worker on `stores` (default: built here); returns them for the rest of the process."""
    stores = stores if stores is not None else WorkerStores.build(settings)
    processor = build_processor(settings, analysis, stores, on_search)
    worker = QueueWorker(
        consumer, stores.redis.transactions, processor, worker_policy(settings), on_processed
    )
    return worker, stores


def build_reconciler(settings: Settings, holder: str, stores: WorkerStores | None = None) -> Reconciler:
    """Reconciliation of this process (a worker replica, `facesearch reconcile`) on its stores (default:
    built here); holder names it on the cluster-wide lease."""
    stores = stores if stores is not None else WorkerStores.build(settings)
    worker = settings.worker
    return Reconciler(
        records=stores.redis.records,
        gallery=stores.gallery,
        transactions=stores.redis.transactions,
        state=RedisReconcileState(stores.redis.redis, prefix=settings.redis.key_prefix),
        holder=holder,
        policy=ReconcilePolicy(
            lock=lock_policy(settings),
            grace_s=worker.reconcile_grace_s,
            batch=worker.reconcile_batch,
            lease_s=worker.reconcile_lease_s,
            model_version=serving_face_model(settings).version,
            orphan_grace_s=settings.retention.orphan_upload_grace_s,
        ),
        blobs=stores.blobs,
    )

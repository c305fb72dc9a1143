"""The worker's object graph from Settings: its stores and thread pools, built once per process and shared
by the queue worker, reconciliation and the background jobs, then the processor, the reconciler, and the
registry of the replica's background loops (WorkerLoops) on them. Used by the worker deployment, the CLI
(`facesearch reconcile`) and the tests. Loads the models' code (calibration), so the ingress never imports
it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, fields
from typing import Any

from models.age_policy import AgeIntervalRule
from serve_app.pipelines.analysis import DeadlineAnalysis, FaceAnalysisBackend
from serve_app.pipelines.index_switch import IndexSwitch, SwitchPolicy, lease_name
from serve_app.pipelines.jobs import BackgroundLoop, run_periodically
from serve_app.pipelines.processing import ProcessingPolicy, TransactionProcessor
from serve_app.pipelines.reconcile import ReconcilePolicy, Reconciler, ReconcileReport
from serve_app.pipelines.result_archive import ResultArchiver, ResultSweeper
from serve_app.pipelines.score_watch import OutcomeReporting, SearchObserver
from serve_app.pipelines.webhooks import WebhookDeliverer
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from serve_app.settings import Settings
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_lease import RedisLease
from serve_app.stores.redis_reconcile import RedisReconcileState
from serve_app.stores.result_archive import BlobResultArchive
from serve_app.wiring.models import score_calibration, serving_face_model
from serve_app.wiring.stores import (
    RedisStores,
    ThreadPools,
    blob_store,
    gallery_store,
    lock_policy,
    redis_stores,
    result_archive,
)

logger = logging.getLogger(__name__)

ARCHIVE_LEASE = "result-archive"  # the background jobs' leases (the index switch's: per collection)
SWEEP_LEASE = "result-sweep"
# A pass of the retention sweep renews its lease after every page (one walk of about a thousand files).
SWEEP_LEASE_S = 120.0


@dataclass(frozen=True)
class WorkerStores:
    """Everything a worker process stores into: one Redis pool (all Redis stores), one Milvus client, and
    the process' thread pools their blocking calls run in (serve_app.wiring.stores.ThreadPools)."""

    redis: RedisStores
    gallery: MilvusGalleryStore
    blobs: LocalBlobStore
    archive: BlobResultArchive
    pools: ThreadPools

    @classmethod
    def build(cls, settings: Settings) -> WorkerStores:
        pools = ThreadPools.build(settings)
        redis = redis_stores(settings)
        return cls(
            redis=redis,
            gallery=gallery_store(settings, redis.redis, pools),
            blobs=blob_store(settings.blobs, pools),
            archive=result_archive(settings, pools),
            pools=pools,
        )

    async def close(self) -> None:
        """The Milvus client and the Redis pool, then the thread pools (the client closes in one)."""
        try:
            await self.gallery.close()
            await self.redis.redis.aclose()
        finally:
            self.pools.shutdown()


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


@dataclass(frozen=True)
class WorkerLoops:
    """The background loops of a worker replica, one entry each (as models/registry.py lists the models):
    what the replica starts, what its health check watches (a loop that ended makes the replica unhealthy,
    and Serve replaces it), and what docs/operations.md lists, each with its lease and interval."""

    consumer: BackgroundLoop  # claims transactions from the work queue and processes them
    webhooks: BackgroundLoop  # delivers completion webhooks
    metrics: BackgroundLoop  # exports the queue's gauges
    reconcile: BackgroundLoop  # repairs Redis/Milvus drift, then sweeps orphaned blobs
    result_archive: BackgroundLoop  # moves results past their hot window to the archive
    result_sweep: BackgroundLoop  # deletes archived results past their retention
    index_switch: BackgroundLoop  # switches the gallery's index once its size calls for it

    def entries(self) -> dict[str, BackgroundLoop]:
        """The loops this configuration runs, by name."""
        loops = (getattr(self, item.name) for item in fields(self))
        return {loop.name: loop for loop in loops if loop.enabled}


def worker_loops(
    settings: Settings,
    holder: str,
    stores: WorkerStores,
    worker: QueueWorker,
    reconciler: Reconciler,
    webhooks: WebhookDeliverer,
    *,
    report_metrics: Callable[[], Awaitable[None]],
    on_reconciled: Callable[[ReconcileReport], None] = lambda report: None,
) -> WorkerLoops:
    """The registry of a replica's loops on its pieces; holder names the replica on the jobs' leases.
    report_metrics exports the gauges once (the deployment's, whose metrics are Ray's)."""
    redis, prefix = stores.redis.redis, settings.redis.key_prefix
    retention, milvus, every = settings.retention, settings.milvus, settings.worker

    async def reconcile_pass() -> None:
        report = await reconciler.run_pass(min_interval_s=every.reconcile_every_s)
        if report is not None:
            logger.info("reconciliation: %s", report)
            on_reconciled(report)

    archiver = ResultArchiver(
        stores.redis.transactions,
        stores.archive,
        RedisLease(redis, ARCHIVE_LEASE, prefix),
        hot_window_s=retention.archive_after_s,
        every_s=retention.result_archive_every_s,
    )

    async def archive_pass() -> None:
        report = await archiver.run_once(holder)
        if report is not None and (report.archived or report.expired):
            logger.info("result archive: %s", report)

    sweeper = ResultSweeper(
        stores.archive,
        RedisLease(redis, SWEEP_LEASE, prefix),
        hot_window_s=retention.archive_after_s,
        every_s=retention.result_sweep_every_s,
        lease_s=SWEEP_LEASE_S,
    )

    async def sweep_pass() -> None:
        report = await sweeper.run_once(holder)
        if report is not None and report.swept:
            logger.info("result sweep: %s", report)

    switch_lease = lease_name(stores.gallery)
    switch = IndexSwitch(
        stores.gallery,
        RedisLease(redis, switch_lease, prefix),
        SwitchPolicy(
            lease_s=milvus.index_switch_lease_s,
            timeout_s=milvus.index_switch_timeout_s,
            every_s=milvus.index_switch_every_s,
        ),
    )

    async def switch_pass() -> None:
        report = await switch.run_once(holder)
        if report is not None and report.switched:
            logger.info("index switch: %s", report)

    def periodic(
        name: str, every_s: float, run_pass: Callable[[], Awaitable[None]]
    ) -> Callable[[asyncio.Event], Coroutine[Any, Any, None]]:
        return lambda stop: run_periodically(name, every_s, run_pass, stop)

    return WorkerLoops(
        consumer=BackgroundLoop(
            "consumer", worker.run, every_s=None, lease=None, lease_s=settings.worker.stale_after_s
        ),
        webhooks=BackgroundLoop(
            "webhooks", webhooks.run, every_s=None, lease=None, lease_s=settings.webhooks.lease_s
        ),
        metrics=BackgroundLoop(
            "metrics",
            periodic("metrics", every.metrics_every_s, report_metrics),
            every_s=every.metrics_every_s,
            lease=None,
            lease_s=None,
        ),
        reconcile=BackgroundLoop(
            "reconcile",
            periodic("reconciliation", every.reconcile_every_s, reconcile_pass),
            every_s=every.reconcile_every_s,
            lease=RedisReconcileState.LEASE,
            lease_s=every.reconcile_lease_s,
        ),
        result_archive=BackgroundLoop(
            "result-archive",
            periodic("result archive", retention.result_archive_every_s, archive_pass),
            every_s=retention.result_archive_every_s,
            lease=ARCHIVE_LEASE,
            lease_s=archiver.lease_s,
            enabled=bool(retention.archive_after_s),  # off: results stay in Redis until they expire
        ),
        result_sweep=BackgroundLoop(
            "result-sweep",
            periodic("result sweep", retention.result_sweep_every_s, sweep_pass),
            every_s=retention.result_sweep_every_s,
            lease=SWEEP_LEASE,
            lease_s=SWEEP_LEASE_S,
            # Also while the archive is off: the copies it made earlier still end with their retention.
            enabled=bool(retention.transaction_retention_s),
        ),
        index_switch=BackgroundLoop(
            "index-switch",
            periodic("index switch", milvus.index_switch_every_s, switch_pass),
            every_s=milvus.index_switch_every_s,
            lease=switch_lease,
            lease_s=milvus.index_switch_lease_s,
        ),
    )

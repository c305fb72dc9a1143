"""The transaction worker deployment: runs the queue consumer loop in each replica."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException

from serve_app.deployments.analysis import AnalysisRecipe
from serve_app.deployments.autoscaling import BACKLOG_METRIC
from serve_app.deployments.metrics import ReconcileMetrics, ScoreMetrics, WebhookMetrics, WorkerMetrics
from serve_app.deployments.user_config import WorkerConfig
from serve_app.domain.errors import BackendUnavailable
from serve_app.pipelines.result_archive import ResultArchiver
from serve_app.settings import Settings
from serve_app.stores.redis_lease import RedisLease
from serve_app.wiring.webhooks import build_deliverer
from serve_app.wiring.worker import WorkerStores, build_reconciler, build_worker, worker_policy

logger = logging.getLogger(__name__)


def consumer_name() -> str:
    """This replica's name in the work queue's consumer group: its Serve replica id, as Serve's logs and
    `serve status` name the replica, so an operator can tell which replica holds which entries. It stays
    the same for the replica's whole life. A replica Serve starts in place of a dead one has a new id; the
    dead one's name leaves the group once its entries were reclaimed (QueueWorker prunes gone consumers).
    Not Serve's replica rank: Serve reassigns ranks among running replicas, so two live replicas could
    come to share a name."""
    try:
        context = serve.get_replica_context()
    except RayServeException:  # constructed outside a Serve replica (never in the deployed graph)
        return f"{socket.gethostname()}-{os.getpid()}"
    return f"{context.deployment}#{context.replica_tag}"


@serve.deployment(
    num_replicas=1, max_ongoing_requests=8, health_check_period_s=10, ray_actor_options={"num_cpus": 0.25}
)
class TransactionWorker:
    def __init__(self, analysis: AnalysisRecipe) -> None:
        """analysis: how this replica analyses, as the topology chose (serve_app.launch.topology): its own
        models, or the model deployments' handles."""
        self._analysis = analysis.build()
        # Read in the replica from its own environment: the signing key and backend credentials are never
        # bind arguments, which Ray pickles into the controller's stored state.
        settings = Settings.from_env()
        self._settings = settings
        self._consumer = consumer_name()
        self._metrics = WorkerMetrics()
        self._score_metrics = ScoreMetrics(settings.worker.score_metrics_tenants)
        # One Redis pool and one Milvus client for the whole replica: worker, reconciliation and archive.
        self._stores = WorkerStores.build(settings)
        self._worker, _ = build_worker(
            settings,
            self._analysis,
            self._consumer,
            self._metrics.observe_transaction,
            self._stores,
            on_search=self._score_metrics.observe_search,
        )
        self._reconciler = build_reconciler(settings, self._consumer, self._stores)
        self._reconcile_metrics = ReconcileMetrics()
        # Completion webhooks: delivered by every replica beside its consumer, off the transactions' path.
        self._webhook_metrics = WebhookMetrics()
        self._webhooks = build_deliverer(
            settings,
            self._stores.redis.redis,
            self._stores.redis.transactions,
            self._stores.redis.records,
            self._stores.archive,
        )
        self._backlog = 0.0  # last queue depth read for the autoscaler
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Serve runs constructors inside the replica's event loop: start consuming right away.
        self._start()

    def _start(self) -> None:
        self._tasks = [
            asyncio.get_running_loop().create_task(coroutine)
            for coroutine in (
                self._worker.run(self._stop),
                self._report(),
                self._reconcile_periodically(),
                self._archive_periodically(),
                self._webhooks.run(self._stop),
            )
        ]

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        # Unknown keys fail the deploy (the replica does not start), naming the key.
        self._worker.update_policy(
            worker_policy(self._settings, **WorkerConfig.model_validate(user_config or {}).model_dump())
        )

    async def _report(self) -> None:
        while not self._stop.is_set():
            try:
                self._metrics.observe_queue(
                    await self._stores.redis.transactions.depth(),
                    self._worker.in_flight,
                    await self._stores.redis.transactions.count_by_state(),
                )
                webhooks = await self._webhooks.queue_stats()
                self._webhook_metrics.observe_queue(webhooks.pending, webhooks.oldest_age_s, webhooks.totals)
                last_pass = await self._reconciler.state.last_completed()
                if last_pass is not None:
                    self._reconcile_metrics.observe_last_pass(last_pass)
            except Exception as error:  # metrics must never stop the worker
                logger.debug("metrics update failed: %r", error)
            await asyncio.sleep(self._settings.worker.metrics_every_s)

    async def _reconcile_periodically(self) -> None:
        """Every replica tries every reconcile_every_s; the lease and the time of the last completed pass
        make that one pass per interval across the cluster (or the rest of a pass whose holder died)."""
        every_s = self._settings.worker.reconcile_every_s
        while not self._stop.is_set():
            await asyncio.sleep(every_s)
            try:
                report = await self._reconciler.run_pass(min_interval_s=every_s)
            except Exception as error:  # a backend outage: try again next round
                logger.warning("reconciliation failed: %r", error)
                continue
            if report is not None:
                logger.info("reconciliation: %s", report)
                self._reconcile_metrics.observe_pass(
                    report.vectors_removed, report.records_removed, report.blobs_removed, report.suspects
                )

    async def _archive_periodically(self) -> None:
        retention = self._settings.retention
        if not retention.archive_after_s:
            return  # results stay in Redis until they expire
        archiver = ResultArchiver(
            self._stores.redis.transactions,
            self._stores.archive,
            RedisLease(self._stores.redis.redis, "result-archive", self._settings.redis.key_prefix),
            hot_window_s=retention.archive_after_s,
            every_s=retention.result_archive_every_s,
        )
        while not self._stop.is_set():
            await asyncio.sleep(retention.result_archive_every_s)
            try:
                report = await archiver.run_once(self._consumer)
                if report is not None and (report.archived or report.expired or report.swept):
                    logger.info("result archive: %s", report)
            except Exception as error:  # a backend outage: nothing was dropped before its copy was written
                logger.warning("result archiving failed: %r", error)

    async def check_health(self) -> None:
        # A replica whose consumer loop died is unhealthy: Serve replaces it, and its claimed entries are
        # reclaimed by the other workers.
        loop_task = self._tasks[0]
        if loop_task.done():
            raise RuntimeError(f"worker loop stopped: {loop_task.exception()!r}")
        await self._analysis.check()

    async def __del__(self) -> None:
        """Serve's graceful shutdown of this replica (a scale-down, a redeploy): stop claiming, finish the
        transactions it holds, renewing their leases meanwhile (QueueWorker.run drains before it returns),
        then stop. Serve kills a replica that takes longer than its graceful_shutdown_timeout_s; the entries
        it held are then reclaimed by another worker after stale_after_s, so nothing is lost either way."""
        self._stop.set()
        consumer, *periodic = self._tasks
        for task in periodic:
            task.cancel()
        await asyncio.gather(consumer, *periodic, return_exceptions=True)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, read by QueueBacklogPolicy (deployments/autoscaling.py) when
        the deployment's autoscaling_config names it; the last known backlog while Redis is away."""
        try:
            self._backlog = float(await self._stores.redis.transactions.depth())
        except BackendUnavailable as error:
            logger.debug("backlog for autoscaling not read: %s", error.message)
        return {BACKLOG_METRIC: self._backlog}

    async def status(self) -> dict[str, Any]:
        return {
            "consumer": self._consumer,
            "in_flight": self._worker.in_flight,
            "processed": self._worker.processed,
        }

"""The transaction worker deployment: runs the worker's background loops in each replica (the queue consumer,
webhook delivery, the metrics export and the leased jobs: serve_app/wiring/worker.py, WorkerLoops), and
fails its health check when any of them has ended, so Serve replaces it."""

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
from serve_app.pipelines.reconcile import ReconcileReport
from serve_app.settings import Settings
from serve_app.stores.redis_support import check_eviction_policy
from serve_app.wiring.webhooks import build_deliverer
from serve_app.wiring.worker import (
    WorkerStores,
    build_reconciler,
    build_worker,
    worker_loops,
    worker_policy,
)

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
        # One Redis pool, one Milvus client and one set of thread pools for the whole replica: worker,
        # reconciliation, the background jobs.
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
        self._loops = worker_loops(
            settings,
            self._consumer,
            self._stores,
            self._worker,
            self._reconciler,
            self._webhooks,
            report_metrics=self._report,
            on_reconciled=self._observe_reconciliation,
        ).entries()
        self._backlog = 0.0  # last queue depth read for the autoscaler
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Serve runs constructors inside the replica's event loop: start consuming right away.
        self._start()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = {
            name: loop.create_task(entry.run(self._stop), name=f"worker loop {name}")
            for name, entry in self._loops.items()
        }
        # Once per replica: an external Redis that may evict keys is a risk to accepted work (logged).
        self._policy_check = loop.create_task(check_eviction_policy(self._stores.redis.redis))

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        # Unknown keys fail the deploy (the replica does not start), naming the key.
        self._worker.update_policy(
            worker_policy(self._settings, **WorkerConfig.model_validate(user_config or {}).model_dump())
        )

    async def _report(self) -> None:
        """One export of the gauges (the metrics loop runs it every metrics_every_s)."""
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

    def _observe_reconciliation(self, report: ReconcileReport) -> None:
        self._reconcile_metrics.observe_pass(
            report.vectors_removed, report.records_removed, report.blobs_removed, report.suspects
        )

    async def check_health(self) -> None:
        """A replica any of whose loops has ended (they run until the replica stops) is unhealthy: Serve
        replaces it, the entries and events it claimed are reclaimed by the other replicas, and the leases
        of the jobs it held lapse for another to take over."""
        for name, task in self._tasks.items():
            if task.done():
                why = "cancelled" if task.cancelled() else repr(task.exception() or "returned")
                raise RuntimeError(f"worker loop {name!r} stopped: {why}")
        await self._analysis.check()

    async def __del__(self) -> None:
        """Serve's graceful shutdown of this replica (a scale-down, a redeploy): stop claiming, finish the
        transactions it holds, renewing their leases meanwhile (QueueWorker.run drains before it returns),
        then stop. Serve kills a replica that takes longer than its graceful_shutdown_timeout_s; the entries
        it held are then reclaimed by another worker after stale_after_s, so nothing is lost either way."""
        self._stop.set()
        consumer = self._tasks.get("consumer")
        others = [task for task in self._tasks.values() if task is not consumer]
        for task in [*others, self._policy_check]:
            task.cancel()
        await asyncio.gather(*self._tasks.values(), self._policy_check, return_exceptions=True)
        await self._stores.close()

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

"""Custom metrics exported through Ray's metrics agent (Prometheus endpoint, Ray dashboard)."""

from __future__ import annotations

from ray.util import metrics

from serve_app.domain.outcomes import FaceSearchOutcome
from serve_app.pipelines.score_watch import best_score

_LATENCY_BOUNDARIES = [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
_SIZE_BOUNDARIES = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]


class ModelMetrics:
    def __init__(self, stage: str) -> None:
        self._tags = {"stage": stage}
        self._batch_requests = metrics.Histogram(
            "facesearch_batch_requests",
            "Requests per model batch",
            boundaries=_SIZE_BOUNDARIES,
            tag_keys=("stage",),
        )
        self._batch_faces = metrics.Histogram(
            "facesearch_batch_faces",
            "Faces per model batch",
            boundaries=_SIZE_BOUNDARIES,
            tag_keys=("stage",),
        )
        self._latency = metrics.Histogram(
            "facesearch_stage_seconds",
            "Model time per batch",
            boundaries=_LATENCY_BOUNDARIES,
            tag_keys=("stage",),
        )

    def observe_batch(self, requests: int, faces: int, seconds: float) -> None:
        self._batch_requests.observe(requests, tags=self._tags)
        self._batch_faces.observe(faces, tags=self._tags)
        self._latency.observe(seconds, tags=self._tags)


class WorkerMetrics:
    def __init__(self) -> None:
        self._queue_depth = metrics.Gauge("facesearch_queue_depth", "Unacknowledged queued transactions")
        self._in_flight = metrics.Gauge(
            "facesearch_worker_in_flight", "Transactions being processed by a worker"
        )
        self._by_state = metrics.Gauge(
            "facesearch_transactions", "Transactions by state", tag_keys=("state",)
        )
        self._latency = metrics.Histogram(
            "facesearch_transaction_seconds", "Time from claim to final state", boundaries=_LATENCY_BOUNDARIES
        )

    def observe_queue(self, depth: int, in_flight: int, by_state: dict[str, int]) -> None:
        self._queue_depth.set(depth)
        self._in_flight.set(in_flight)
        for state, count in by_state.items():
            self._by_state.set(count, tags={"state": state})

    def observe_transaction(self, seconds: float) -> None:
        self._latency.observe(seconds)


# Match scores are -log10(FMR) / 10 (models.calibration): a bucket per decade of the false-match rate.
_SCORE_BOUNDARIES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
OTHER_TENANTS = "_other"
ALL_TENANTS = "_all"


class ScoreMetrics:
    """What each tenant's face searches score, to watch for a shift (a camera changed, a new population):
    searches by result (match: at least one match reached the tenant's threshold; no_match; no_face) and
    the best match's score when there was one. Labelled by tenant, for the first `max_tenants` tenants this
    replica serves; later ones share `tenant="_other"` (0: every search under `_all`), so the number of
    series stays bounded however many tenants there are (docs/operations.md)."""

    def __init__(self, max_tenants: int) -> None:
        self._max_tenants = max_tenants
        self._labelled: set[str] = set()
        self._searches = metrics.Counter(
            "facesearch_face_searches",
            "Face searches completed, by tenant and result: match (a match reached the threshold), "
            "no_match, no_face (no face found in the image)",
            tag_keys=("tenant", "result"),
        )
        self._best_score = metrics.Histogram(
            "facesearch_best_match_score",
            "Score of the best match of each face search that returned one (-log10(FMR) / 10)",
            boundaries=_SCORE_BOUNDARIES,
            tag_keys=("tenant",),
        )

    def tenant_label(self, tenant: str) -> str:
        if self._max_tenants == 0:
            return ALL_TENANTS
        if tenant in self._labelled:
            return tenant
        if len(self._labelled) < self._max_tenants:
            self._labelled.add(tenant)
            return tenant
        return OTHER_TENANTS

    def observe_search(self, tenant: str, outcome: FaceSearchOutcome) -> None:
        label = self.tenant_label(tenant)
        best = best_score(outcome)
        result = "no_face" if not outcome.is_face_found else "no_match" if best is None else "match"
        self._searches.inc(1, tags={"tenant": label, "result": result})
        if best is not None:
            self._best_score.observe(best, tags={"tenant": label})


class ReconcileMetrics:
    """Reconciliation: faces repaired by this replica's passes (summed over replicas by Prometheus), and when
    the cluster's last pass completed (read from Redis, so every replica exports the same time)."""

    def __init__(self) -> None:
        self._repaired = metrics.Counter(
            "facesearch_reconcile_repaired",
            "Faces and blobs repaired by reconciliation: a vector without its record deleted (kind=vector), "
            "a record without its vector removed (kind=record), an orphaned blob swept (kind=blob)",
            tag_keys=("kind",),
        )
        self._last_pass = metrics.Gauge(
            "facesearch_reconcile_last_pass_timestamp_seconds",
            "When the last complete reconciliation pass ended (seconds since the epoch)",
        )
        self._suspects = metrics.Gauge(
            "facesearch_reconcile_suspects",
            "Faces the last pass saw inconsistent and left for a later pass (in their grace period or still "
            "being enrolled)",
        )

    def observe_pass(
        self, vectors_removed: int, records_removed: int, blobs_removed: int, suspects: int
    ) -> None:
        for kind, count in (
            ("vector", vectors_removed),
            ("record", records_removed),
            ("blob", blobs_removed),
        ):
            if count:
                self._repaired.inc(count, tags={"kind": kind})
        self._suspects.set(suspects)

    def observe_last_pass(self, completed_at: float) -> None:
        self._last_pass.set(completed_at)


class WebhookMetrics:
    """Completion webhooks as Redis holds them, so every replica exports the same cluster-wide values (the
    dashboard takes their max) and the totals survive replica restarts: attempts settled by outcome, events
    waiting, and the age of the oldest one."""

    def __init__(self) -> None:
        self._totals = metrics.Gauge(
            "facesearch_webhook_events",
            "Webhook delivery attempts settled, by outcome: delivered (2xx), retried (any other answer, a "
            "refusal, a timeout or a connection error, with time left), dead (given up); totals",
            tag_keys=("outcome",),
        )
        self._pending = metrics.Gauge(
            "facesearch_webhook_pending", "Webhook events not yet delivered or dead"
        )
        self._oldest = metrics.Gauge(
            "facesearch_webhook_queue_age_seconds",
            "Age of the oldest webhook event not yet delivered or dead (0: none waiting)",
        )

    def observe_queue(self, pending: int, oldest_age_s: float, totals: dict[str, int]) -> None:
        self._pending.set(pending)
        self._oldest.set(oldest_age_s)
        for outcome, count in totals.items():
            self._totals.set(count, tags={"outcome": outcome})

"""Custom metrics exported through Ray's metrics agent (Prometheus endpoint, Ray dashboard)."""

from __future__ import annotations

from ray.util import metrics

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

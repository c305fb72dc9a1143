"""Batched model runners: RunnerBatcher (any runner from models/runners.py behind serve.batch) and the model
deployment that serves one.

CPU (one machine): no model deployment; the transaction worker owns a RunnerBatcher of the whole analysis,
because on a 2-core box every deployment hop costs about as much CPU as a model. Split topology: one
deployment per model that models.registry gives one, each BatchedModel under the name its entry gives
(MODEL_DEPLOYMENTS), bound to its stage; their user_config is user_config.BatchConfig.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, cast

from ray import serve

from models.analyzer import load_runner
from models.registry import Stage
from models.runners import BatchRunner
from serve_app.deployments.batch_merging import BatchMerger
from serve_app.deployments.lanes import InferenceLane
from serve_app.deployments.metrics import ModelMetrics
from serve_app.deployments.user_config import MODEL_DEPLOYMENTS, BatchConfig
from serve_app.settings import Settings
from serve_app.wiring.models import model_config as with_face_model

logger = logging.getLogger(__name__)

# Serve's batch queue hands a closed batch to the handler only while fewer than its max_concurrent_batches
# are in the handler. The lane, not Serve, limits the runs here, and BatchMerger can only merge the batches
# it has been handed: so Serve's limit is far above anything that waits in a worker at once.
_BATCHES_HANDED_OVER = 256


class RunnerBatcher:
    """A model runner behind serve.batch: calls from concurrent requests are gathered into one run (sizes
    from BatchConfig, changeable live), which runs off the event loop. Used by the model deployments and,
    on one machine, inside the transaction worker. Up to `concurrent_batches` runs at once (the lane's
    places, fixed for the replica's life); batches that wait for a place are merged into one run when a
    place frees up (BatchMerger), up to max_batch_size requests."""

    def __init__(
        self,
        stage: Literal["analysis"] | Stage,
        model_config: dict[str, Any] | None = None,
        concurrent_batches: int = 1,
    ) -> None:
        # The face model comes from the replica's own settings (FACESEARCH_FACE_MODEL_*), as the stores'
        # gallery version does.
        config = with_face_model(model_config, Settings())
        self._runner: BatchRunner = load_runner(stage, config)
        self._lane = InferenceLane(concurrent_batches)
        self._metrics = ModelMetrics(stage)
        self._batch = BatchConfig()
        self._merger: BatchMerger[Any, Any] = BatchMerger(
            self._lane, self._run_items, lambda: self._batch.max_batch_size, self._observe
        )
        # Built per instance: a module-level serve.batch would share one queue between instances.
        self._batched = serve.batch(max_concurrent_batches=_BATCHES_HANDED_OVER)(self._merger.run)
        self.configure(self._batch)

    def configure(self, batch: BatchConfig) -> None:
        self._batch = batch
        self._batched.set_max_batch_size(batch.max_batch_size)  # type: ignore[attr-defined]
        self._batched.set_batch_wait_timeout_s(batch.batch_wait_timeout_s)  # type: ignore[attr-defined]

    async def run(self, item: Any) -> Any:
        """One item's output; the item joins whichever batch is being gathered."""
        return await self._batched(item)

    def _run_items(self, items: list[Any]) -> list[Any]:
        outputs: list[Any] = self._runner.run(items, self._batch.max_faces_per_run)
        return outputs

    def _observe(self, requests: int, outputs: list[Any], seconds: float) -> None:
        self._metrics.observe_batch(requests, sum(map(len, outputs)), seconds)

    async def check(self) -> None:
        await self._lane.run(self._runner.check)


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10, ray_actor_options={"num_cpus": 1})
class BatchedModel:
    """One model stage as a deployment; callers send one item to `run` and get that item's output."""

    def __init__(self, stage: Stage, model_config: dict[str, Any] | None = None) -> None:
        self._batcher = RunnerBatcher(stage, model_config)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        # Unknown keys fail the deploy (the replica does not start), naming the key.
        self._batcher.configure(BatchConfig.model_validate(user_config or {}))

    async def run(self, item: Any) -> Any:
        return await self._batcher.run(item)

    async def check_health(self) -> None:
        await self._batcher.check()


def model_deployment(name: str) -> Any:
    """The split topology's deployment of that name (user_config.MODEL_DEPLOYMENTS), to bind with its stage.
    (Serve's decorator returns a Deployment, which its type hints do not say.)"""
    if name not in MODEL_DEPLOYMENTS:
        raise ValueError(f"no model deployment {name!r}; the registry's: {sorted(MODEL_DEPLOYMENTS)}")
    return cast(Any, BatchedModel).options(name=name)

"""Batched model runners: RunnerBatcher (any runner from models/runners.py behind serve.batch) and the model
deployment that serves one.

CPU (one machine): no model deployment; the transaction worker owns a RunnerBatcher of the whole analysis,
because on a 2-core box every deployment hop costs about as much CPU as a model. GPU config:
FaceDetectorModel, FaceEmbedderModel and AgeModel, each with a fractional GPU so it scales on its own. All
three are BatchedModel under the name the config files use, bound to a different stage; their user_config is
user_config.BatchConfig.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ray import serve

from models.analyzer import ModelConfig
from models.runners import BatchRunner, Stage, load_runner
from serve_app.deployments.metrics import ModelMetrics
from serve_app.deployments.user_config import BatchConfig

logger = logging.getLogger(__name__)
_Result = TypeVar("_Result")


class InferenceLane:
    """Runs a replica's blocking inference in worker threads, at most `runs` calls at a time.

    Off the event loop, the replica keeps receiving requests while a batch computes, so the next batch is
    assembled in the meantime instead of after it (ONNX Runtime releases the GIL while it runs). Health
    checks take a place in the lane like a batch. ONNX Runtime sessions and dlib's predictor may be called
    from several threads at once, so `runs` > 1 only needs the cores: on a small CPU box two single-threaded
    runs keep both cores busy through the parts of a batch that one thread does alone (dlib's landmarks,
    the chips, NMS), which intra-op threads cannot share (docs/performance.md)."""

    def __init__(self, runs: int = 1) -> None:
        if runs < 1:
            raise ValueError(f"an inference lane needs at least one run at a time, got {runs}")
        self._places = asyncio.Semaphore(runs)

    async def run(self, function: Callable[..., _Result], *args: Any) -> _Result:
        async with self._places:
            return await asyncio.to_thread(function, *args)


class RunnerBatcher:
    """A model runner behind serve.batch: calls from concurrent requests are gathered into one run (sizes
    from BatchConfig, changeable live), which runs off the event loop. Used by the model deployments and,
    on one machine, inside the transaction worker. Up to `concurrent_batches` batches run at once (fixed for
    the replica's life: Serve's batch queue takes it when it is created)."""

    def __init__(
        self, stage: Stage, model_config: dict[str, Any] | None = None, concurrent_batches: int = 1
    ) -> None:
        self._runner: BatchRunner = load_runner(stage, ModelConfig.from_dict(model_config or {}))
        self._lane = InferenceLane(concurrent_batches)
        self._metrics = ModelMetrics(stage)
        self._batch = BatchConfig()
        # Built per instance, since the number of concurrent batches is the instance's own.
        self._batched = serve.batch(max_concurrent_batches=concurrent_batches)(self._run_batch)
        self.configure(self._batch)

    def configure(self, batch: BatchConfig) -> None:
        self._batch = batch
        self._batched.set_max_batch_size(batch.max_batch_size)  # type: ignore[attr-defined]
        self._batched.set_batch_wait_timeout_s(batch.batch_wait_timeout_s)  # type: ignore[attr-defined]

    async def run(self, item: Any) -> Any:
        """One item's output; the item joins whichever batch is being gathered."""
        return await self._batched(item)

    async def _run_batch(self, items: list[Any]) -> list[Any]:
        started = time.perf_counter()
        outputs = await self._lane.run(self._runner.run, items, self._batch.max_faces_per_run)
        self._metrics.observe_batch(len(items), sum(map(len, outputs)), time.perf_counter() - started)
        return outputs

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


# The deployments the GPU topology and its config files name (serve_app.launch.topology.DEPLOYMENTS).
# (Serve's decorator returns a Deployment, which its type hints do not say.)
FaceDetectorModel = cast(Any, BatchedModel).options(name="FaceDetectorModel")
FaceEmbedderModel = cast(Any, BatchedModel).options(name="FaceEmbedderModel")
AgeModel = cast(Any, BatchedModel).options(name="AgeModel")

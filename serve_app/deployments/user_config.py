"""The application's deployments by the names the config files use (USER_CONFIGS, the one table of them),
and their `user_config` shapes: what a Serve config may set on running replicas. Pydantic models that
reject unknown keys, so a typo fails the deploy with a message naming the key. No Ray here: the launcher
(serve_app.launch.deploy_config) checks a config file with them before it starts anything.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.registry import MODELS, Stage


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(Strict):
    """A model deployment's user_config: batching, changeable on running replicas."""

    # Also the most requests a merged run takes (batch_merging). The defaults are the CPU's (the GPU config
    # sets its own): one thread's model CPU per image stops falling at about 3 requests a run, and a larger
    # merged run holds all its callers until its last face is done while the other lane may sit idle.
    # 4 instead of 16: face search +2-4% at 8 clients, age +1-9%, face search p95 at 32 clients 1.0-1.05 s
    # instead of 1.13-1.20 (docs/performance.md).
    max_batch_size: int = Field(4, ge=1)
    # How long Serve holds a batch open for more arrivals. Batches that wait for a busy lane run as one
    # anyway (batch_merging), so on CPU a wait only adds latency: 0 (measured in docs/performance.md). The
    # GPU config sets its own.
    batch_wait_timeout_s: float = Field(0.0, ge=0)
    # Chips per ONNX run: a batch of requests is cut into runs of this many faces.
    max_faces_per_run: int = Field(64, ge=1)


class WorkerConfig(Strict):
    """The transaction worker's user_config; unset fields keep Settings.worker's values."""

    concurrency: int | None = Field(None, ge=1)
    stale_after_s: float | None = Field(None, gt=0)
    max_deliveries: int | None = Field(None, ge=1)


class NoUserConfig(Strict):
    """Deployments that take no user_config (any key is a mistake)."""


# The deployments every topology has: the ingress and the transaction worker (their classes in
# serve_app/deployments carry these names; a unit test checks that they agree).
INGRESS = "ApiIngress"
WORKER = "TransactionWorker"
# The split topology's model deployments, by name: one per model the registry gives a deployment, and the
# stage each serves.
MODEL_DEPLOYMENTS: dict[str, Stage] = MODELS.deployments()

# Every deployment name -> the model of its user_config; serve_app.launch.topology.DEPLOYMENTS reads it.
USER_CONFIGS: dict[str, type[BaseModel]] = {
    INGRESS: NoUserConfig,
    WORKER: WorkerConfig,
    **dict.fromkeys(MODEL_DEPLOYMENTS, BatchConfig),
}


def validate_user_config(deployment: str, user_config: dict[str, Any] | None) -> None:
    """Raise ValueError naming the deployment and the offending key when a user_config does not fit."""
    try:
        USER_CONFIGS[deployment].model_validate(user_config or {})
    except ValidationError as error:
        raise ValueError(f"{deployment}.user_config: {error}") from None

"""The one place that turns a config's topology into the Serve application: its deployments and the
worker's analysis backend.

`serve run config/serve.yaml` imports `serve_app.launch.topology:build_app` with the YAML's `args`; the
launcher (`facesearch start`) and the tests call bind_app. Two topologies:
- in_process (CPU, one machine; the default): ApiIngress and TransactionWorker, the worker owning the models
  (OwnModels), so a transaction costs no handle hop. The worker is scaled on the queue's backlog.
- split (GPU cluster): ApiIngress -> TransactionWorker -> one deployment per model that models.registry gives
  one (ModelDeployments: the worker holds their handles). When the config requires CUDA, each model
  deployment asks for its registry share of a GPU unless the config sets its ray_actor_options.
The ingress holds the worker's handle only so the worker is part of the application; work passes between
them through Redis (the transaction stream), never through that handle.

Building the graph starts nothing and binds no settings: every replica reads its own from its process
environment (Settings.from_env), so the signing key and backend credentials never become bind arguments,
which Ray pickles into the controller's stored state. Redis and Milvus are whatever REDIS_URL / MILVUS_URI
say in the replicas' environment (the launcher exports the embedded servers' addresses before it starts
Ray, whose processes inherit them; on a cluster, every node's environment names them).

The arguments (AppArgs) are checked without Ray (the config files' unit tests); the deployments are
imported when a graph is bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.deployments.user_config import (
    INGRESS,
    MODEL_DEPLOYMENTS,
    USER_CONFIGS,
    WORKER,
    Strict,
    validate_user_config,
)
from serve_app.settings import Settings

if TYPE_CHECKING:
    from ray.serve import Application

Topology = Literal["in_process", "split"]

# The deployments of each topology, by the names the config files use (user_config's table).
DEPLOYMENTS: dict[Topology, tuple[str, ...]] = {
    "in_process": (INGRESS, WORKER),
    "split": tuple(USER_CONFIGS),
}


class AppArgs(Strict):
    """build_app's `args` (the `args:` of a Serve config's application)."""

    topology: Topology = "in_process"
    # models.analyzer.ModelConfig's fields; checked by ModelConfig.from_dict, which names unknown keys.
    models: dict[str, Any] = Field(default_factory=dict, alias="model_config")
    # in_process: how many analysis batches the worker runs at once, each on model_config's intra-op
    # threads. On a small CPU box, one single-threaded batch per core keeps every core busy through the
    # single-threaded parts of a batch (docs/performance.md).
    concurrent_batches: int = Field(1, ge=1)
    # Per-deployment Serve options (what a config's `deployments:` list says), by deployment name; the
    # launcher folds the config's list in here so it applies exactly what `serve run` would.
    deployment_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("models")
    @classmethod
    def _model_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        from models.analyzer import ModelConfig

        ModelConfig.from_dict(value)
        return value

    @model_validator(mode="after")
    def _deployments(self) -> AppArgs:
        if self.topology != "in_process" and self.concurrent_batches != 1:
            raise ValueError(
                "concurrent_batches is the in_process worker's; the split topology's model deployments batch "
                "on their own (their user_config)"
            )
        known = DEPLOYMENTS[self.topology]
        for name, options in self.deployment_options.items():
            if name not in known:
                raise ValueError(f"deployment {name!r} is not part of the {self.topology} topology {known}")
            validate_user_config(name, options.get("user_config"))
        return self


def _require_backends() -> None:
    """Fail the build, not every replica, when the environment names no servers (the same environment the
    replicas will read, on one machine)."""
    settings = Settings()
    if not (settings.redis.url and settings.milvus.uri):
        raise RuntimeError(
            "REDIS_URL and MILVUS_URI must name the servers: start with `facesearch start`, or run "
            "`facesearch backends` (embedded servers on this machine) and export what it prints"
        )


def build_app(args: dict[str, Any]) -> Application:
    """The builder `serve run` / `serve deploy` call with a config's `args` (Serve requires exactly one
    parameter)."""
    return bind_app(args)


def bind_app(args: dict[str, Any] | AppArgs) -> Application:
    """The application graph for these args; its deployments read their settings in their replicas."""
    from models.analyzer import ModelConfig
    from models.registry import MODELS
    from serve_app.deployments.analysis import AnalysisRecipe, ModelDeployments, OwnModels
    from serve_app.deployments.ingress import ApiIngress
    from serve_app.deployments.models import model_deployment
    from serve_app.deployments.worker import TransactionWorker

    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    _require_backends()
    model_config = app_args.models

    def configured(deployment: Any, defaults: dict[str, Any] | None = None) -> Any:
        # Serve's decorator leaves the class type to type checkers. The config's options win over defaults.
        extra = {**(defaults or {}), **app_args.deployment_options.get(deployment.name, {})}
        return deployment.options(**extra) if extra else deployment

    analysis: AnalysisRecipe
    if app_args.topology == "in_process":
        analysis = OwnModels(model_config, app_args.concurrent_batches)
    else:
        requires_gpu = ModelConfig.from_dict(model_config).requires_accelerator()
        handles = {}
        for name, stage in MODEL_DEPLOYMENTS.items():
            deployment = model_deployment(name)
            share = MODELS.entry(stage).gpu_share
            # Serve replaces ray_actor_options as a whole: the defaults carry the deployment's CPU too.
            defaults = {"ray_actor_options": {**deployment.ray_actor_options, "num_gpus": share}}
            handles[stage] = configured(deployment, defaults if requires_gpu and share else None).bind(
                stage, model_config
            )
        # Bound deployments inside the recipe: Serve finds them there and hands the worker their handles.
        analysis = ModelDeployments(handles, model_config)
    worker = configured(TransactionWorker).bind(analysis)
    app: Application = configured(ApiIngress).bind(worker)
    return app

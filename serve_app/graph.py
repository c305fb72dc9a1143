"""The one place that binds the Serve application graph.

`serve run config/serve.yaml` imports `serve_app.graph:build_app` with the YAML's `args`; the launcher
(`facesearch start`) and the tests call bind_app. Topologies:
- fused (CPU default): ApiIngress -> TransactionWorker -> FaceAnalysisModel (all models in one replica)
- split (GPU): ApiIngress -> TransactionWorker -> FaceDetectorModel, FaceEmbedderModel, AgeModel
- in_process (CPU, no worker->model hop): ApiIngress, TransactionWorker owning the models itself
The ingress holds the worker's handle only so the worker is part of the application; work passes between
them through Redis (the transaction stream), never through that handle.

Building the graph starts nothing and binds no settings: every replica reads its own from its process
environment (Settings.from_env), so the signing key and backend credentials never become bind arguments,
which Ray pickles into the controller's stored state. Redis and Milvus are whatever REDIS_URL / MILVUS_URI
say in the replicas' environment (the launcher exports the embedded servers' addresses before it starts
Ray, whose processes inherit them; on a cluster, every node's environment names them).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application

from serve_app.deploy_config import AppArgs
from serve_app.deployments.ingress import ApiIngress
from serve_app.deployments.models import AgeModel, FaceAnalysisModel, FaceDetectorModel, FaceEmbedderModel
from serve_app.deployments.worker import TransactionWorker
from serve_app.settings import Settings

logger = logging.getLogger(__name__)


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
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    _require_backends()
    model_config = app_args.models

    def configured(deployment: Any) -> Any:  # Serve's decorator leaves the class type to type checkers
        extra = app_args.deployment_options.get(deployment.name)
        return deployment.options(**extra) if extra else deployment

    if app_args.topology == "in_process":
        worker = configured(TransactionWorker).bind(model_config=model_config, in_process=True)
    elif app_args.topology == "fused":
        analysis = configured(FaceAnalysisModel).bind("analysis", model_config)
        worker = configured(TransactionWorker).bind(analysis_model=analysis)
    else:
        worker = configured(TransactionWorker).bind(
            detector=configured(FaceDetectorModel).bind("detector", model_config),
            embedder=configured(FaceEmbedderModel).bind("embedder", model_config),
            age=configured(AgeModel).bind("age", model_config),
            model_config=model_config,
        )
    app: Application = configured(ApiIngress).bind(worker)
    return app

"""The one place that binds the Serve application graph.

`serve run config/serve.yaml` imports `serve_app.graph:build_app` with the YAML's `args`; the launcher
(`facesearch start`) and the tests call bind_app with settings of their own. Topologies:
- fused (CPU default): ApiIngress -> TransactionWorker -> FaceAnalysisModel (all models in one replica)
- split (GPU): ApiIngress -> TransactionWorker -> FaceDetectorModel, FaceEmbedderModel, AgeModel
- in_process (CPU, no worker->model hop): ApiIngress, TransactionWorker owning the models itself
The ingress and the worker meet only in Redis (the transaction stream), never through a handle.

Building the graph starts nothing: Redis and Milvus are whatever REDIS_URL / MILVUS_URI say (the launcher
sets them to the embedded servers it started, see serve_app/embedded.py).
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


def _require_backends(settings: Settings) -> Settings:
    if not (settings.redis.url and settings.milvus.uri):
        raise RuntimeError(
            "REDIS_URL and MILVUS_URI must name the servers: start with `facesearch start`, or run "
            "`facesearch backends` (embedded servers on this machine) and export what it prints"
        )
    return settings


def build_app(args: dict[str, Any]) -> Application:
    """The builder `serve run` / `serve deploy` call with a config's `args` (Serve requires exactly one
    parameter); settings come from the environment."""
    return bind_app(args, Settings.from_env())


def bind_app(args: dict[str, Any] | AppArgs, settings: Settings) -> Application:
    """The application graph for these args and settings (the launcher and the tests pass their own)."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    settings = _require_backends(settings)
    model_config = app_args.models

    def configured(deployment: Any) -> Any:  # Serve's decorator leaves the class type to type checkers
        extra = app_args.deployment_options.get(deployment.name)
        return deployment.options(**extra) if extra else deployment

    if app_args.topology == "in_process":
        worker = configured(TransactionWorker).bind(settings, model_config=model_config, in_process=True)
    elif app_args.topology == "fused":
        analysis = configured(FaceAnalysisModel).bind("analysis", model_config)
        worker = configured(TransactionWorker).bind(settings, analysis_model=analysis)
    else:
        worker = configured(TransactionWorker).bind(
            settings,
            detector=configured(FaceDetectorModel).bind("detector", model_config),
            embedder=configured(FaceEmbedderModel).bind("embedder", model_config),
            age=configured(AgeModel).bind("age", model_config),
            model_config=model_config,
        )
    app: Application = configured(ApiIngress).bind(settings, worker)
    return app

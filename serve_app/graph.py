"""The one place that binds the Serve application graph.

`serve run config/serve.yaml` imports `serve_app.graph:build_app` with the YAML's `args`; the launcher
(`facesearch start`) and the tests call build_app too. Topologies:
- fused (CPU default): ApiIngress -> TransactionWorker -> FaceAnalysisModel (all models in one replica)
- split (GPU): ApiIngress -> TransactionWorker -> FaceDetectorModel, FaceEmbedderModel, AgeModel
The ingress and the worker meet only in Redis (the transaction stream), never through a handle.

Building the graph starts nothing: Redis and Milvus are whatever REDIS_URL / MILVUS_URI say, unless the
application args ask for embedded servers (`embedded_backends: true`) or the launcher started them.
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


def _backends(settings: Settings, embedded: bool) -> Settings:
    if settings.redis.url and settings.milvus.uri:
        return settings
    if not embedded:
        raise RuntimeError(
            "REDIS_URL and MILVUS_URI must name the servers, or the application args must say "
            "`embedded_backends: true` (one machine), or start with `facesearch start`"
        )
    from serve_app.embedded import start_embedded_backends

    return start_embedded_backends(settings)


def build_app(args: dict[str, Any] | AppArgs | None = None, settings: Settings | None = None) -> Application:
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    settings = _backends(settings or Settings.from_env(), app_args.embedded_backends)
    model_config = app_args.models

    def configured(deployment: Any) -> Any:  # Serve's decorator leaves the class type to type checkers
        extra = app_args.deployment_options.get(deployment.name)
        return deployment.options(**extra) if extra else deployment

    if app_args.topology == "fused":
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
    return configured(ApiIngress).bind(settings, worker)

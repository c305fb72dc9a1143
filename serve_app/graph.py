"""The one place that binds the Serve application graph.

`serve run config/serve.yaml` imports `serve_app.graph:build_app` with the YAML's `args`; the launcher
(`facesearch start`) and the tests call build_app too. Topologies:
- fused (CPU default): ApiIngress -> TransactionWorker -> FaceAnalysisModel (all models in one replica)
- split (GPU): ApiIngress -> TransactionWorker -> FaceDetectorModel, FaceEmbedderModel, AgeModel
The ingress and the worker meet only in Redis (the transaction stream), never through a handle.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Any

from ray.serve import Application

from serve_app.deployments.ingress import ApiIngress
from serve_app.deployments.models import AgeModel, FaceAnalysisModel, FaceDetectorModel, FaceEmbedderModel
from serve_app.deployments.worker import TransactionWorker
from serve_app.embedded import EmbeddedServices
from serve_app.settings import Settings

logger = logging.getLogger(__name__)
TOPOLOGIES = ("fused", "split")


def resolve_backends(settings: Settings) -> Settings:
    """Start embedded redis-server / milvus-lite (bound to 127.0.0.1) for whichever URL is not configured.

    Started servers belong to the calling process and stop when it exits; a live server left by an earlier
    run in the same data dir is reused.
    """
    if settings.redis_url and settings.milvus_uri:
        return settings
    services = EmbeddedServices(
        settings.data_dir, redis=settings.redis_url is None, milvus=settings.milvus_uri is None
    )
    services.start()
    atexit.register(services.stop)
    return dataclasses.replace(
        settings,
        redis_url=settings.redis_url or services.redis_url,
        milvus_uri=settings.milvus_uri or services.milvus_uri,
    )


def build_app(args: dict[str, Any] | None = None, settings: Settings | None = None) -> Application:
    args = dict(args or {})
    topology = str(args.get("topology", "fused"))
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    model_config: dict[str, Any] = dict(args.get("model_config") or {})
    options: dict[str, dict[str, Any]] = dict(args.get("deployment_options") or {})
    settings = resolve_backends(settings or Settings.from_env())

    def configured(deployment: Any) -> Any:
        extra = options.get(deployment.name)
        return deployment.options(**extra) if extra else deployment

    if topology == "fused":
        analysis = configured(FaceAnalysisModel).bind(model_config)
        worker = configured(TransactionWorker).bind(settings, analysis_model=analysis)
    else:
        worker = configured(TransactionWorker).bind(
            settings,
            detector=configured(FaceDetectorModel).bind(model_config),
            embedder=configured(FaceEmbedderModel).bind(model_config),
            age=configured(AgeModel).bind(model_config),
            model_config=model_config,
        )
    return configured(ApiIngress).bind(settings, worker)

"""The HTTP ingress. It talks only to Redis and the blob store: creating a transaction is persisting it and
queueing it, so the ingress never waits on a model and never holds work that could be lost."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.api.app import create_app
from serve_app.api_wiring import build_api_services
from serve_app.settings import Settings


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, ray_actor_options={"num_cpus": 0.25})
@serve.ingress()
class ApiIngress:
    def __init__(self, settings: Settings, worker: DeploymentHandle[Any] | None = None) -> None:
        # The worker handle is held only so the worker deployment is part of the application graph.
        self._worker = worker
        self._services = build_api_services(settings)

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self._services)

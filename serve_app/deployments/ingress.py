"""The HTTP ingress. It talks to Redis and the blob store (and to Milvus only to remove faces for the
gallery extension): creating a transaction is persisting it and queueing it, so the ingress never waits on
a model and never holds work that could be lost."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.api.app import create_app
from serve_app.deployments.front_door import behind_the_front_door, trusting_the_front_door
from serve_app.settings import Settings
from serve_app.wiring.api import build_api_services


# Ray Serve's documented ingress decorator, in the form its docstring (ray 2.60, serve/api.py `ingress`)
# gives for an app built at replica start: `@serve.ingress()` with no app, and the class defines
# `__serve_build_asgi_app__`, called after __init__. The other two forms do not fit: `@serve.ingress(app)`
# needs a FastAPI object at import time, i.e. a module-level app holding routes and state for every
# replica (a module-level singleton), and a builder function is called with no arguments, so it cannot
# reach the services this replica's __init__ builds from its settings. create_app(services) keeps the
# app a plain function of its services, which the unit tests call directly without Ray.
@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, ray_actor_options={"num_cpus": 0.25})
@serve.ingress()
class ApiIngress:
    def __init__(self, worker: DeploymentHandle[Any] | None = None) -> None:
        # The worker handle is held only so the worker deployment is part of the application graph.
        self._worker = worker
        # Settings come from this replica's own environment (secrets never travel as bind arguments).
        settings = Settings.from_env()
        if behind_the_front_door():
            # HAProxy is every request's peer here; the client is in its X-Forwarded-For.
            settings = trusting_the_front_door(settings)
        self._services = build_api_services(settings)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self._services)

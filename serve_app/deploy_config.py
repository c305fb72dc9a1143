"""The shapes of what a Serve config file may say: the application's `args` and each deployment's
`user_config`. Each is a pydantic model that rejects unknown keys, so a typo fails the deploy with a message
naming the key instead of being ignored. No Ray here: the config files are checked by unit tests, and the
launcher validates a file before it starts anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Strict):
    """A model deployment's user_config: batching, changeable on running replicas."""

    max_batch_size: int = Field(16, ge=1)
    batch_wait_timeout_s: float = Field(0.005, ge=0)
    # Chips per ONNX run: a batch of requests is cut into runs of this many faces.
    max_faces_per_run: int = Field(64, ge=1)


class WorkerConfig(_Strict):
    """The transaction worker's user_config; unset fields keep Settings.worker's values."""

    concurrency: int | None = Field(None, ge=1)
    stale_after_s: float | None = Field(None, gt=0)
    max_deliveries: int | None = Field(None, ge=1)


class NoUserConfig(_Strict):
    """Deployments that take no user_config (any key is a mistake)."""


Topology = Literal["fused", "split", "in_process"]

# Deployment name -> the model of its user_config, per topology. The names are those of the deployment
# classes in serve_app/deployments (a unit test checks that they agree).
USER_CONFIGS: dict[str, type[_Strict]] = {
    "ApiIngress": NoUserConfig,
    "TransactionWorker": WorkerConfig,
    "FaceAnalysisModel": BatchConfig,
    "FaceDetectorModel": BatchConfig,
    "FaceEmbedderModel": BatchConfig,
    "AgeModel": BatchConfig,
}
DEPLOYMENTS: dict[Topology, tuple[str, ...]] = {
    "fused": ("ApiIngress", "TransactionWorker", "FaceAnalysisModel"),
    "split": ("ApiIngress", "TransactionWorker", "FaceDetectorModel", "FaceEmbedderModel", "AgeModel"),
    "in_process": ("ApiIngress", "TransactionWorker"),
}


class AppArgs(_Strict):
    """serve_app.graph:build_app's `args` (the `args:` of a Serve config's application)."""

    topology: Topology = "fused"
    # models.analyzer.ModelConfig's fields; checked by ModelConfig.from_dict, which names unknown keys.
    models: dict[str, Any] = Field(default_factory=dict, alias="model_config")
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
        known = DEPLOYMENTS[self.topology]
        for name, options in self.deployment_options.items():
            if name not in known:
                raise ValueError(f"deployment {name!r} is not part of the {self.topology} topology {known}")
            validate_user_config(name, options.get("user_config"))
        return self


def validate_user_config(deployment: str, user_config: dict[str, Any] | None) -> None:
    """Raise ValueError naming the deployment and the offending key when a user_config does not fit."""
    try:
        USER_CONFIGS[deployment].model_validate(user_config or {})
    except ValidationError as error:
        raise ValueError(f"{deployment}.user_config: {error}") from None


# Ray Serve's own switch (read by its processes at start-up) for direct ingress: the ingress replica runs
# its own HTTP server, so a request skips Serve's HTTP proxy and the proxy-to-replica actor call. A config
# turns it on in its application's runtime_env; the launcher then gives that server the public port.
DIRECT_INGRESS_FLAG = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


class ServeConfig(NamedTuple):
    args: AppArgs
    http_options: dict[str, Any]
    direct_ingress: bool


def load_serve_config(path: Path) -> ServeConfig:
    """The application args, http options and ingress mode of a Serve config YAML (its first application),
    the deployments' settings folded into args.deployment_options and everything validated."""
    document = yaml.safe_load(path.read_text())
    return parse_serve_config(document)


def parse_serve_config(document: dict[str, Any]) -> ServeConfig:
    application = document["applications"][0]
    args = dict(application.get("args") or {})
    deployment_options: dict[str, dict[str, Any]] = {}
    for entry in application.get("deployments", []):
        entry = dict(entry)
        deployment_options[entry.pop("name")] = entry
    args["deployment_options"] = deployment_options
    env_vars = ((application.get("runtime_env") or {}).get("env_vars")) or {}
    direct_ingress = str(env_vars.get(DIRECT_INGRESS_FLAG, "0")) == "1"
    if direct_ingress:
        ingress = deployment_options.get("ApiIngress", {})
        # Serve's own default is one replica, so leaving num_replicas out is fine.
        if ingress.get("num_replicas", 1) != 1 or "autoscaling_config" in ingress:
            raise ValueError(
                f"{DIRECT_INGRESS_FLAG}: the ingress replica serves the public port itself, so ApiIngress "
                "needs num_replicas: 1 (a second replica would listen on another port, behind no proxy)"
            )
    return ServeConfig(AppArgs.model_validate(args), dict(document.get("http_options") or {}), direct_ingress)


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment for Ray (set before it starts, so its controller and replicas read it) that puts the
    one ingress replica's own HTTP server on `port`. The port range is that one port, and a released port is
    not held back (Ray quarantines it for a while by default), so a restarted ingress replica comes back on
    the same port. Ray holds a stopping ingress replica open for a draining period (30 s by default) so that a
    load balancer can deregister it; with none in front, it only waits for the requests in flight."""
    return {
        DIRECT_INGRESS_FLAG: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }

"""What a Serve config file says, read and checked before anything starts: the application's `args`
(serve_app.launch.topology.AppArgs), Serve's http options, the environment its Ray processes need and
whether the ingress serves its port itself (direct ingress). Every part is a pydantic model that rejects
unknown keys, so a typo fails with a message naming the key instead of being ignored. No Ray here: the
config files are checked by unit tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml

from serve_app.deployments.user_config import INGRESS
from serve_app.launch.topology import AppArgs

# Ray Serve's own switch (read by its processes at start-up) for direct ingress: the ingress replica runs
# its own HTTP server, so a request skips Serve's HTTP proxy and the proxy-to-replica actor call. A config
# turns it on in its application's runtime_env; the launcher then gives that server the public port.
DIRECT_INGRESS_FLAG = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


class ServeConfig(NamedTuple):
    args: AppArgs
    http_options: dict[str, Any]
    direct_ingress: bool
    # The application's runtime_env env_vars: Ray Serve's own switches, which its processes read when they
    # start. `serve run` hands them to the application's replicas; the launcher and the test harness put
    # them in the environment Ray starts in, so Serve's controller and proxy read them too.
    env_vars: dict[str, str]


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
    env_vars = {
        str(name): str(value)
        for name, value in (((application.get("runtime_env") or {}).get("env_vars")) or {}).items()
    }
    direct_ingress = env_vars.get(DIRECT_INGRESS_FLAG, "0") == "1"
    if direct_ingress:
        ingress = deployment_options.get(INGRESS, {})
        # Serve's own default is one replica, so leaving num_replicas out is fine.
        if ingress.get("num_replicas", 1) != 1 or "autoscaling_config" in ingress:
            raise ValueError(
                f"{DIRECT_INGRESS_FLAG}: the ingress replica serves the public port itself, so ApiIngress "
                "needs num_replicas: 1 (a second replica would listen on another port, behind no proxy)"
            )
    return ServeConfig(
        AppArgs.model_validate(args), dict(document.get("http_options") or {}), direct_ingress, env_vars
    )


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

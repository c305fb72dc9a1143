"""What a Serve config file says, read and checked before anything starts: the application's `args`
(serve_app.launch.topology.AppArgs), Serve's http options, the environment its Ray processes need and
whether its ingress replicas sit behind the front door (HAProxy on the public port,
serve_app/launch/haproxy.py). Every part is a pydantic model that rejects unknown keys, so a typo fails
with a message naming the key instead of being ignored. No Ray here: the config files are checked by unit
tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml

from serve_app.deployments.front_door import DIRECT_INGRESS_FLAG as DIRECT_INGRESS_FLAG
from serve_app.deployments.front_door import FRONT_DOOR_FLAG as FRONT_DOOR_FLAG
from serve_app.launch.topology import AppArgs


class ServeConfig(NamedTuple):
    args: AppArgs
    http_options: dict[str, Any]
    # The ingress replicas serve HTTP themselves (Ray Serve's direct ingress) behind the front door: the
    # application asks for HAProxy on the public port (RAY_SERVE_ENABLE_HA_PROXY in its runtime_env), which
    # spreads requests over every replica's own server. Otherwise Serve's HTTP proxy takes the requests (a
    # Ray cluster's config, docs/scaling.md).
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
    direct_ingress = env_vars.get(FRONT_DOOR_FLAG, "0") == "1"
    if env_vars.get(DIRECT_INGRESS_FLAG, "0") == "1" and not direct_ingress:
        # Without the front door, each ingress replica would serve a port of its own that no client knows,
        # and one that dies would leave its clients refused until it is back.
        raise ValueError(
            f'{DIRECT_INGRESS_FLAG} needs the front door: set {FRONT_DOOR_FLAG}: "1" as well (HAProxy on '
            "the public port in front of the ingress replicas' own servers), or neither (Serve's HTTP proxy)"
        )
    return ServeConfig(
        AppArgs.model_validate(args), dict(document.get("http_options") or {}), direct_ingress, env_vars
    )

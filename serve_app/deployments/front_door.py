"""What an ingress replica knows of the front door: HAProxy, which Ray Serve 2.60 runs on each node when
RAY_SERVE_ENABLE_HA_PROXY is set, owns the public port and spreads requests over every ApiIngress replica's
own HTTP server (direct ingress), with health checks and retries (serve_app/launch/haproxy.py starts it).

Behind it, a replica's peer is HAProxy, not the client. HAProxy appends the client's address to
X-Forwarded-For, and on its own node it connects to the replicas from FRONT_DOOR_SOURCE_ADDRESS, an address
of the loopback network that no client uses by accident: believing X-Forwarded-For from that address only
gives each client its own per-source allowance (serve_app/api/limits.py), while a local client, which
connects from 127.0.0.1, still cannot choose its bucket by sending the header itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from serve_app.settings import Settings

# Ray Serve's own switch for the HAProxy mode (read by its processes at start-up; it implies direct ingress).
FRONT_DOOR_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
# Ray Serve's switch for direct ingress: each ingress replica runs its own HTTP server.
DIRECT_INGRESS_FLAG = "RAY_SERVE_ENABLE_DIRECT_INGRESS"

# The address HAProxy connects to the replicas of its own node from (the `source` of each loopback server
# in its configuration). Linux answers the whole 127.0.0.0/8 on the loopback interface.
FRONT_DOOR_SOURCE_ADDRESS = "127.0.0.2"


def behind_the_front_door(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(FRONT_DOOR_FLAG, "0") == "1"


def trusting_the_front_door(settings: Settings) -> Settings:
    """The settings with the front door's source address added to the trusted proxies, so that its
    X-Forwarded-For names the client (the operator's own proxies, FACESEARCH_TRUSTED_PROXIES, stay)."""
    trusted = settings.http.trusted_proxies
    address = f"{FRONT_DOOR_SOURCE_ADDRESS}/32"
    if address in trusted:
        return settings
    http = settings.http.model_copy(update={"trusted_proxies": (*trusted, address)})
    return settings.model_copy(update={"http": http})

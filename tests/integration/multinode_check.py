"""Two Ray nodes, one worker node lost mid-burst: run inside network namespace A by test_multinode.py.

    ip netns exec A python -m tests.integration.multinode_check WORK_DIR

Namespace A (10.250.0.1) holds the Ray head, Redis and the Milvus server (the `milvus` wheel's, listening
on A's veth address so node B reaches it), and this script, the HTTP client of the head's Serve port.
Namespace B (10.250.0.2) holds a Ray worker node with the custom resource `models`; the Serve config pins
the replica that runs the models (the TransactionWorker, which owns them in the default topology) to it and
the ingress to the head. Ray's token authentication is on.

1. Enrol four people; run a list of face searches and age estimations undisturbed: the reference results.
2. Run the same list again and, a third of the way in, kill every process of namespace B (`ip netns pids`,
   never `ray stop`); restart node B with the same `ray start` after a pause.
3. Every request answered with a reference_id must reach a final state with the reference results, and
   the worker replica (with its models) must be running on node B again.

Prints one JSON line `{"accepted": .., "completed": .., "lost": .., ...}` and exits non-zero on failure.
Processes are not stopped here: the test removes both namespaces with everything in them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from models.weights import default_models_dir
from serve_app.launch.deploy_config import parse_serve_config
from serve_app.launch.embedded import EmbeddedRedis
from tests.faces_dev import load_faces_dev
from tests.integration.api_client import age_estimation, auth, face_search_json
from tests.milvus_server import MilvusServerProcess
from tests.netns import pids

ROOT = Path(__file__).resolve().parents[2]
HEAD_IP, NODE_IP = "10.250.0.1", "10.250.0.2"
RAY_PORT, REDIS_PORT, MILVUS_PORT, HTTP_PORT, DASHBOARD_PORT = 6379, 6390, 19530, 8000, 8265
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
DASHBOARD = f"http://127.0.0.1:{DASHBOARD_PORT}"
STALE_AFTER_S = 8  # a transaction whose worker died is reclaimed and retried after this (30 s by default)
MODEL_DEPLOYMENT = "TransactionWorker"  # the worker owns the models (config/serve.yaml)
KILL_AFTER = 1 / 3  # of the burst's requests sent
NODE_DOWN_S = 8.0  # long enough for Ray to notice; the replacement replica waits for the node


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ray_env(work: Path, token: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    # Not RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: anything but 1/true there refuses a second node.
    env.update(
        {
            "HOME": str(work / "home"),  # no ~/.ray/auth_token of the machine's user
            "FACESEARCH_MODELS_DIR": str(default_models_dir()),  # the converted models, found via HOME
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
            "FORWARDED_ALLOW_IPS": "",
        }
    )
    return env


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def start_head(work: Path, env: dict[str, str]) -> None:
    subprocess.run(
        [ray_cli(), "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={RAY_PORT}",
         f"--temp-dir={work / 'ray-a'}", "--num-cpus=2", '--resources={"head": 1}',
         "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}", "--disable-usage-stats"],
        env=env, check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def start_node_b(work: Path, env: dict[str, str], namespace: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, ray_cli(), "start", f"--address={HEAD_IP}:{RAY_PORT}",
         f"--node-ip-address={NODE_IP}", f"--temp-dir={work / 'ray-b'}", "--num-cpus=1",
         '--resources={"models": 1}', "--disable-usage-stats"],
        env=env, check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def kill_namespace(namespace: str) -> int:
    """SIGKILL every process of the namespace: node B's raylet, workers and replica all at once."""
    killed = 0
    while left := pids(namespace):
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return killed


def serve_config(work: Path, env_vars: dict[str, str]) -> Path:
    """config/serve.yaml (the one-machine CPU topology) with the worker, which owns the models, pinned to
    node B's custom resource and the ingress to the head's. Serve's proxy on the head takes the requests
    (direct ingress is a one-machine setting)."""
    document: dict[str, Any] = yaml.safe_load((ROOT / "config/serve.yaml").read_text())
    document["proxy_location"] = "HeadOnly"
    document["http_options"] = {"host": "127.0.0.1", "port": HTTP_PORT}
    app = document["applications"][0]
    app["runtime_env"] = {"env_vars": env_vars}
    app["args"]["model_config"] = {"intra_op_threads": 1}
    for deployment in app["deployments"]:
        if deployment["name"] == MODEL_DEPLOYMENT:
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = 1
            deployment["ray_actor_options"] = {"num_cpus": 1, "resources": {"models": 1}}
        else:
            deployment["ray_actor_options"] = {"num_cpus": 0.25, "resources": {"head": 0.1}}
    parse_serve_config(document)  # the same validation as `facesearch start`
    path = work / "serve-multinode.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.5)


def model_replicas(token: str) -> list[dict[str, Any]]:
    """The replicas running the models as the dashboard's Serve API reports them (token required)."""
    response = httpx.get(f"{DASHBOARD}/api/serve/applications/", headers=auth(token), timeout=10)
    response.raise_for_status()
    app = response.json().get("applications", {}).get("facesearch")
    if not app:
        return []
    replicas: list[dict[str, Any]] = app["deployments"][MODEL_DEPLOYMENT].get("replicas", [])
    return replicas


def running_on_b(token: str) -> bool:
    try:
        return any(r["state"] == "RUNNING" and r.get("node_ip") == NODE_IP for r in model_replicas(token))
    except (httpx.HTTPError, KeyError):
        return False


def healthy() -> bool:
    try:
        return httpx.get(f"{BASE_URL}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def final(http: httpx.Client, token: str, reference_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = http.post("/result", headers=auth(token), json={"reference_id": reference_id})
        if response.status_code != 202:
            body: dict[str, Any] = response.json()
            body["http_status"] = response.status_code
            return body
        time.sleep(0.3)
    raise TimeoutError(reference_id)


def comparable(body: dict[str, Any]) -> Any:
    """What must not change between runs: the answer, not its ids, proof URLs or the float's last bits."""
    data = body.get("result", {}).get("data") or {}
    if "face_search_response" in data:
        found = data["face_search_response"]["result"]
        matches = [(m[0], round(float(m[1]), 3), m[3]) for m in found["matched_faces"]]
        return (body["http_status"], body.get("status"), found["is_face_found"], matches)
    if "age" in data:
        return (body["http_status"], body.get("status"), data["age"], data["under_18"], data["under_21"])
    return (body["http_status"], body.get("status"), body.get("message"))


def diagnose(work: Path, token: str) -> None:
    """On failure: what Serve says, and the end of the controller's and the replicas' logs."""
    with contextlib.suppress(Exception):
        response = httpx.get(f"{DASHBOARD}/api/serve/applications/", headers=auth(token), timeout=10)
        log(f"serve applications: {response.text[-4000:]}")
    for pattern in (
        "ray-a/session_latest/logs/serve/controller_*.log",
        "ray-*/session_latest/logs/serve/replica_*",
    ):
        for path in sorted(work.glob(pattern))[-3:]:
            log(f"--- {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    token = secrets.token_hex(32)
    try:
        return scenario(work, argv[1], token)
    except BaseException:
        diagnose(work, token)
        raise


def scenario(work: Path, namespace_b: str, token: str) -> int:
    (work / "home").mkdir(parents=True, exist_ok=True)
    env = ray_env(work, token)
    started = time.monotonic()

    redis_password = secrets.token_hex(16)
    (work / "redis").mkdir()
    subprocess.Popen(
        [EmbeddedRedis.binary(), "--bind", HEAD_IP, "--port", str(REDIS_PORT),
         "--requirepass", redis_password, "--save", "", "--appendonly", "no", "--dir", str(work / "redis")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    milvus = MilvusServerProcess(work / "milvus", MILVUS_PORT, host=HEAD_IP)
    milvus.start()
    log(f"Redis and the Milvus server up in A ({time.monotonic() - started:.1f} s)")

    start_head(work, env)
    start_node_b(work, env, namespace_b)
    log(f"Ray head in A, worker node in B ({time.monotonic() - started:.1f} s)")

    secret_key = secrets.token_urlsafe(48)
    app_env = {
        "FACESEARCH_ENV": "production",
        "FACESEARCH_SECRET_KEY": secret_key,
        "REDIS_URL": f"redis://:{redis_password}@{HEAD_IP}:{REDIS_PORT}/0",
        "MILVUS_URI": milvus.uri,
        "FACESEARCH_DATA_DIR": str(work / "data"),
        "FACESEARCH_BLOB_DIR": str(work / "blobs"),  # one filesystem for both nodes (same machine)
        "FACESEARCH_STALE_AFTER_S": str(STALE_AFTER_S),
    }
    config = serve_config(work, app_env)
    deploy = subprocess.run(
        [str(Path(sys.executable).with_name("serve")), "deploy", str(config), "--address", DASHBOARD],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if deploy.returncode != 0:
        raise RuntimeError(f"serve deploy failed: {deploy.stdout}{deploy.stderr}")
    poll(lambda: healthy() and running_on_b(token), 240, "application running with its worker on node B")
    log(f"deployed with `serve deploy`, worker (models) on node B ({time.monotonic() - started:.1f} s)")

    # Token auth is on across the nodes: the dashboard refuses a caller without the token.
    assert httpx.get(f"{DASHBOARD}/api/serve/applications/", timeout=10).status_code == 401

    os.environ.update(app_env)
    from serve_app.settings import Settings
    from serve_app.wiring.stores import redis_stores

    settings = Settings.from_env()

    async def new_client() -> tuple[str, str]:
        info, client_secret = await redis_stores(settings).clients.create("multinode")
        return info.client_id, client_secret

    client_id, client_secret = asyncio.run(new_client())
    dev = load_faces_dev()
    people = list(dev.by_identity().items())[:4]
    ages = [image.path for image in dev.of_kind("age")][:4]
    with httpx.Client(base_url=BASE_URL, timeout=60) as http:
        login = http.post(
            "/request-access-token", json={"client_id": client_id, "client_secret": client_secret}
        )
        login.raise_for_status()
        access = str(login.json()["result"]["data"]["token"])
        for identity, photos in people:
            sent = face_search_json(http, access, photos[0].path, client_reference=f"ref-{identity}")
            body = final(http, access, sent.json()["result"]["data"]["reference_id"], 120)
            assert body["result"]["data"]["face_search_response"]["result"]["is_face_found"], body
        # The burst: each person's other photos searched (no enrolment), and age estimations.
        requests: list[Callable[[], httpx.Response]] = []
        for _identity, photos in people:
            for photo in photos[1:4]:
                requests.append(functools.partial(face_search_json, http, access, photo.path, enroll_face=0))
        for crop in ages:
            requests.append(functools.partial(age_estimation, http, access, crop, enroll_face=0))
        requests = requests * 2

        def send_all(on_sent: Callable[[list[str | None]], None] | None = None) -> list[str | None]:
            references: list[str | None] = []
            for request in requests:
                response = request()
                ok = response.status_code == 200 and response.json().get("status") is True
                references.append(str(response.json()["result"]["data"]["reference_id"]) if ok else None)
                if on_sent is not None:
                    on_sent(references)
                time.sleep(0.05)
            return references

        baseline_refs = send_all()
        assert all(baseline_refs), baseline_refs
        baseline = [comparable(final(http, access, ref, 180)) for ref in baseline_refs if ref]
        log(f"undisturbed run: {len(baseline)} transactions final ({time.monotonic() - started:.1f} s)")

        def is_final(ref: str) -> bool:
            answer = http.post("/result", headers=auth(access), json={"reference_id": ref})
            return answer.status_code != 202

        killed_at: list[float] = []
        unfinished_at_kill: list[int] = []
        sent_before_kill: list[int] = []
        restarted = threading.Event()

        def restart_later() -> None:
            time.sleep(NODE_DOWN_S)
            start_node_b(work, env, namespace_b)
            restarted.set()

        def on_sent(references: list[str | None]) -> None:
            if not killed_at and len(references) >= len(requests) * KILL_AFTER:
                killed = kill_namespace(namespace_b)
                killed_at.append(time.monotonic())
                threading.Thread(target=restart_later, daemon=True).start()
                # Those not final yet were queued or on the killed replica: the kill hit work in flight.
                unfinished = [ref for ref in references if ref and not is_final(ref)]
                unfinished_at_kill.append(len(unfinished))
                sent_before_kill.append(len(references))
                log(
                    f"killed {killed} processes of node B after {len(references)} of {len(requests)} "
                    f"requests; {len(unfinished)} of them not final"
                )

        burst_refs = send_all(on_sent)
        accepted = [ref for ref in burst_refs if ref]
        outcomes: list[Any] = []
        lost = 0
        for ref in accepted:
            try:
                outcomes.append(comparable(final(http, access, ref, 240)))
            except TimeoutError:
                lost += 1
                outcomes.append(None)
        restarted.wait(60)
        poll(lambda: running_on_b(token), 120, "worker replica on node B after the restart")
        expected = [result for result, ref in zip(baseline, burst_refs, strict=True) if ref]
        same = sum(1 for got, want in zip(outcomes, expected, strict=True) if got == want)
        summary = {
            "sent": len(requests),
            "accepted": len(accepted),
            "completed": sum(1 for outcome in outcomes if outcome is not None),
            "same_as_undisturbed": same,
            "lost": lost,
            "unfinished_when_killed": unfinished_at_kill[0],
            "sent_after_the_kill": len(requests) - sent_before_kill[0],
            "replica_back_on_node_b": True,
            "seconds": round(time.monotonic() - started, 1),
        }
        print(json.dumps(summary), flush=True)
        for got, want in zip(outcomes, expected, strict=True):
            if got != want:
                log(f"differs: {got} != {want}")
        assert lost == 0 and same == len(accepted), summary
    milvus.stop()
    shutil.rmtree(work / "milvus", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

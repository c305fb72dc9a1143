"""The split (GPU) topology end to end, run as its own process: one Ray per process, and the test session
already holds one for the default service (tests/integration/conftest.py).

    python -m tests.integration.split_service_check [split|in_process]

Enrols the first photo of four identities, searches with a second photo of each (its own reference must
rank first), and asks for an age with wait_for_result=1 (check_search_and_age, which the default service
passes too). Exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx

from serve_app.deployments.autoscaling import BACKLOG_METRIC
from serve_app.deployments.user_config import MODEL_DEPLOYMENTS
from serve_app.launch.deploy_config import load_serve_config
from tests.faces_dev import load_faces_dev
from tests.integration.api_client import age_estimation, auth, face_search_json
from tests.service_harness import RunningService, running_service

ROOT = Path(__file__).resolve().parents[2]
# Three model replicas must fit next to the ingress and worker on a 2-CPU box.
SPLIT_ARGS: dict[str, Any] = {
    "topology": "split",
    "model_config": {"intra_op_threads": 1},
    "deployment_options": {name: {"ray_actor_options": {"num_cpus": 0.5}} for name in MODEL_DEPLOYMENTS},
}


def _final(http: httpx.Client, token: str, reference_id: str) -> dict[str, Any]:
    for _ in range(240):
        response = http.post("/result", headers=auth(token), json={"reference_id": reference_id})
        if response.status_code == 200:
            body: dict[str, Any] = response.json()
            return body
        time.sleep(0.5)
    raise AssertionError(f"{reference_id} not final in time")


def check_search_and_age(service: RunningService, tenant: str) -> None:
    """The end-to-end assertions both topologies must pass (test_split_topology.py runs them on each)."""
    dev = load_faces_dev()
    people = list(dev.by_identity().items())[:4]
    token = service.token_for(service.new_client(tenant))
    with service.http(60) as http:
        for identity, photos in people:
            sent = face_search_json(http, token, photos[0].path, client_reference=f"ref-{identity}")
            result = _final(http, token, sent.json()["result"]["data"]["reference_id"])
            assert result["result"]["data"]["face_search_response"]["result"]["is_face_found"] is True
        for identity, photos in people:
            sent = face_search_json(http, token, photos[1].path, enroll_face=0)
            found = _final(http, token, sent.json()["result"]["data"]["reference_id"])
            matches = found["result"]["data"]["face_search_response"]["result"]["matched_faces"]
            assert matches and matches[0][3] == f"ref-{identity}", (identity, matches)
            print(f"{identity}: {matches[0][3]} first, score {matches[0][1]}")
        crop = dev.of_kind("age")[0]
        answer = age_estimation(http, token, crop.path, enroll_face=0, wait_for_result=1).json()
        data = answer["result"]["data"]
        assert isinstance(data["age"], int) and data["under_18"] in (0, 50, 100), data
        print(f"age crop {crop.path.name}: {data['age']}")


def check_backlog_metric() -> None:
    """The in-process worker reports the queue's backlog to Serve's autoscaler (QueueBacklogPolicy)."""
    from ray import serve

    worker = serve.get_deployment_handle("TransactionWorker", "facesearch")
    stats = worker.record_autoscaling_stats.remote().result(timeout_s=60)
    assert set(stats) == {BACKLOG_METRIC} and stats[BACKLOG_METRIC] >= 0, stats
    print(f"worker reports {stats}")


def check_scales_on_backlog(service: RunningService) -> None:
    """A burst of age estimations queues faster than one worker (concurrency 1) drains it: the autoscaler
    adds the second worker replica, and removes it again once the queue is empty."""
    from ray import serve

    def workers() -> dict[str, int]:
        states = serve.status().applications["facesearch"].deployments["TransactionWorker"].replica_states
        # Keyed by state name at run time, though typed as ReplicaState.
        return {str(getattr(state, "value", state)): count for state, count in states.items()}

    token = service.token_for(service.new_client("autoscaling"))
    crops = [image.path for image in load_faces_dev().of_kind("age")]
    with service.http(60) as http:
        for index in range(BURST):
            age_estimation(http, token, crops[index % len(crops)], enroll_face=0).raise_for_status()
    _poll(lambda: workers().get("RUNNING", 0) + workers().get("STARTING", 0) >= 2, 120, "a second worker")
    print(f"scaled up: {workers()}")
    _poll(lambda: workers() == {"RUNNING": 1}, 300, "the scale-down to one worker")
    print(f"scaled down: {workers()}")


def _poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.5)


BURST = 300
# The default CPU topology as shipped (the worker owns the models and is autoscaled on the queue's backlog),
# with the autoscaler's clock sped up and a low target so the scaling check takes seconds: one replica per 4
# queued, one transaction at a time per replica.
IN_PROCESS_CONFIG = load_serve_config(ROOT / "config/serve.yaml")
IN_PROCESS_ARGS: dict[str, Any] = IN_PROCESS_CONFIG.args.model_dump(by_alias=True)
_WORKER = IN_PROCESS_ARGS["deployment_options"]["TransactionWorker"]
_WORKER["autoscaling_config"] |= {
    "upscale_delay_s": 0,
    "downscale_delay_s": 5,
    "metrics_interval_s": 1,
    "look_back_period_s": 2,
}
_WORKER["autoscaling_config"]["policy"]["policy_kwargs"] = {"target_backlog_per_replica": 4}
_WORKER["user_config"] = {"concurrency": 1}
_WORKER["ray_actor_options"] = {"num_cpus": 0.5}  # room for the second replica on a 2-CPU box
TOPOLOGIES = {"split": SPLIT_ARGS, "in_process": IN_PROCESS_ARGS}
# As shipped: the default config has clients call the ingress replica's own HTTP server.
DIRECT_INGRESS = {"split": False, "in_process": IN_PROCESS_CONFIG.direct_ingress}
# And with its Ray Serve switches, as `facesearch start` exports them.
ENVIRONMENT: dict[str, dict[str, str]] = {"split": {}, "in_process": IN_PROCESS_CONFIG.env_vars}


def main(argv: list[str]) -> int:
    topology = argv[0] if argv else "split"
    with (
        tempfile.TemporaryDirectory() as data_dir,
        running_service(
            Path(data_dir),
            TOPOLOGIES[topology],
            env=ENVIRONMENT[topology],
            direct_ingress=DIRECT_INGRESS[topology],
        ) as service,
    ):
        check_search_and_age(service, topology)
        if topology == "in_process":
            check_backlog_metric()
            check_scales_on_backlog(service)
    print(f"{topology} topology OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The split (GPU) topology end to end, run as its own process: one Ray per process, and the test session
already holds one for the fused service (tests/integration/conftest.py).

    python -m tests.integration.split_service_check [split|in_process]

Enrols the first photo of four identities, searches with a second photo of each (its own reference must
rank first), and asks for an age with wait_for_result=1 (check_search_and_age, which the fused service
passes too). Exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx

from tests.faces_dev import load_faces_dev
from tests.integration.api_client import age_estimation, auth, face_search_json
from tests.service_harness import RunningService, running_service

# Three model replicas must fit next to the ingress and worker on a 2-CPU box.
SPLIT_ARGS: dict[str, Any] = {
    "topology": "split",
    "model_config": {"intra_op_threads": 1},
    "deployment_options": {
        name: {"ray_actor_options": {"num_cpus": 0.5}}
        for name in ("FaceDetectorModel", "FaceEmbedderModel", "AgeModel")
    },
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


# The CPU topology without the worker->model hop: the worker owns the models (one replica, one CPU).
IN_PROCESS_ARGS: dict[str, Any] = {
    "topology": "in_process",
    "model_config": {"intra_op_threads": 1},
    "deployment_options": {"TransactionWorker": {"ray_actor_options": {"num_cpus": 1}}},
}
TOPOLOGIES = {"split": SPLIT_ARGS, "in_process": IN_PROCESS_ARGS}


def main(argv: list[str]) -> int:
    topology = argv[0] if argv else "split"
    with (
        tempfile.TemporaryDirectory() as data_dir,
        running_service(Path(data_dir), TOPOLOGIES[topology]) as service,
    ):
        check_search_and_age(service, topology)
    print(f"{topology} topology OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

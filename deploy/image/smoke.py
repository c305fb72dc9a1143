"""Smoke test of a built image: start it, use the API from outside as a client would, stop it.

    python -m deploy.image.smoke [--image localhost/facesearch:cpu] [--port 18000]

What it proves, each step stopping the run with a message when it fails:
  1. the container starts and answers GET /healthz on 127.0.0.1:<port> (published to loopback only);
  2. `facesearch clients create` inside the container makes an API client;
  3. a multipart face search enrols photo 1 of a person from the dev set (../shared/testdata/faces-dev, read
     in place, never copied), a JSON face search with photo 2 of the same person finds it;
  4. the match's proof URL serves the enrolled image's bytes (a JPEG);
  5. an age estimation of a labelled face answers an age;
  6. `stop` (SIGTERM) shuts the service down gracefully: the container exits with code 0.
The container is removed at the end whatever happened.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from facesearch_client import FaceSearchClient
from facesearch_client.models import AgeResult, FaceSearchResult, Pending
from tests.faces_dev import load_faces_dev

ENGINE = str(Path(__file__).resolve().with_name("engine.sh"))
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120


class SmokeFailure(Exception):
    pass


def engine(*args: str, check: bool = True, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and completed.returncode != 0:
        raise SmokeFailure(f"engine {' '.join(args[:2])} failed ({completed.returncode}): {completed.stderr}")
    return completed


def step(message: str) -> None:
    print(f"[smoke] {message}", flush=True)


def running(name: str) -> bool:
    state = engine("inspect", "--format", "{{.State.Running}}", name, check=False)
    return state.stdout.strip() == "true"


def wait_healthy(base_url: str, name: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT_S:
        if not running(name):
            raise SmokeFailure("the container exited before answering /healthz")
        try:
            response = httpx.get(f"{base_url}/healthz", timeout=5.0)
            if response.status_code == 200:
                step(f"GET /healthz -> 200 {response.text} after {time.monotonic() - started:.0f} s")
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(2.0)
    raise SmokeFailure(f"/healthz did not answer 200 within {START_TIMEOUT_S:.0f} s")


def create_client(name: str) -> tuple[str, str]:
    created = engine("exec", name, "facesearch", "clients", "create", "image-smoke")
    record = json.loads(created.stdout.strip().splitlines()[-1])
    step(f"facesearch clients create (in the container) -> client_id {record['client_id']}")
    return str(record["client_id"]), str(record["client_secret"])


def face_search(client: FaceSearchClient) -> None:
    faces_dev = load_faces_dev()
    identity, photos = next(iter(faces_dev.by_identity().items()))
    if len(photos) < 2:
        raise SmokeFailure(f"{identity} has fewer than two photos in {faces_dev.root}")
    reference = f"smoke-{identity}"
    enrolled = client.search(photos[0].path, client_reference=reference)
    if not enrolled.is_face_found:
        raise SmokeFailure(f"multipart search: no face found in {photos[0].path.name}")
    step(f"multipart face search enrolled {photos[0].path.name} as {reference}")
    found = client.wait(client.submit_face_search(photos[1].path, enroll_face=False, as_json=True), 120.0)
    if not isinstance(found, FaceSearchResult):
        raise SmokeFailure(f"JSON search: unexpected answer {found!r}")
    same = [match for match in found.matches if match.client_reference == reference]
    if not same:
        raise SmokeFailure(f"JSON search with {photos[1].path.name} missed {reference}: {found.matches}")
    best = max(same, key=lambda match: match.score)
    step(f"JSON face search with {photos[1].path.name} found {reference}, score {best.score:.3f}")
    proof = client.proof(best.proof_url)
    if not proof.startswith(b"\xff\xd8\xff"):
        raise SmokeFailure(f"the proof URL answered {len(proof)} bytes that are not a JPEG")
    step(f"proof URL -> {len(proof)} bytes of JPEG")


def age_estimation(client: FaceSearchClient) -> None:
    labelled = next(image for image in load_faces_dev().of_kind("age") if image.age is not None)
    answer = client.age_estimation(labelled.path, enroll_face=False)
    final = client.wait(answer.reference_id, 120.0) if isinstance(answer, Pending) else answer
    if not isinstance(final, AgeResult) or final.age is None:
        raise SmokeFailure(f"age estimation of {labelled.path.name}: no age in {final!r}")
    step(f"age estimation of {labelled.path.name} (labelled {labelled.age}) -> age {final.age}")


def stop(name: str) -> None:
    started = time.monotonic()
    engine("stop", "--time", str(STOP_TIMEOUT_S), name, timeout=STOP_TIMEOUT_S + 60)
    code = engine("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    if code != "0":
        raise SmokeFailure(f"the container exited with code {code} on stop, not 0")
    step(f"stop (SIGTERM) -> exit code 0 after {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.image.smoke", description=__doc__)
    parser.add_argument("--image", default="localhost/facesearch:cpu")
    parser.add_argument("--port", type=int, default=18000)
    parser.add_argument("--shm-size", default="2g", help="Ray's object store lives in /dev/shm")
    options = parser.parse_args(argv)
    name = f"facesearch-smoke-{os.getpid()}"
    base_url = f"http://127.0.0.1:{options.port}"
    started = time.monotonic()
    engine(
        "run", "--detach", "--name", name, "--shm-size", options.shm_size,
        "-p", f"127.0.0.1:{options.port}:8000", options.image,
    )  # fmt: skip
    step(f"started {options.image} as {name}, port 8000 published on {base_url}")
    try:
        wait_healthy(base_url, name)
        client_id, secret = create_client(name)
        with FaceSearchClient(base_url, client_id, secret) as client:
            face_search(client)
            age_estimation(client)
        stop(name)
    except Exception as error:  # any failure: show the service's log, then clean up
        logs = engine("logs", "--tail", "60", name, check=False)
        print(logs.stdout + logs.stderr, file=sys.stderr)
        print(f"[smoke] FAILED: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        engine("rm", "--force", name, check=False)
    step(f"passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

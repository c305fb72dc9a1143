"""Mixed traffic against a running service: enrol, search, age estimation, result polling, proof downloads.

    FACESEARCH_CLIENT_ID=... FACESEARCH_CLIENT_SECRET=... \
    locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 2m --host http://127.0.0.1:8000

Photos come from FACES_DEV_DIR (default ../shared/testdata/faces-dev). Every run is bounded by -t; each
simulated user also stops itself after MAX_TASKS_PER_USER tasks, so a run ends even without -t.
"""

from __future__ import annotations

import base64
import os
import random
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, between, events, task
from locust.exception import StopUser

MAX_TASKS_PER_USER = int(os.environ.get("FACESEARCH_LOAD_MAX_TASKS", "500"))
POLL_TIMEOUT_S = 30.0
_DEFAULT_PHOTOS = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "faces-dev"


def _photos() -> dict[str, list[Path]]:
    root = Path(os.environ.get("FACES_DEV_DIR", str(_DEFAULT_PHOTOS)))
    kinds: dict[str, list[Path]] = {"face": [], "age": [], "neg": [], "group": []}
    for path in sorted(root.iterdir()):
        prefix = path.name.split("_")[0]
        if prefix in kinds and path.suffix.lower() in (".jpg", ".jpeg", ".png"):
            kinds[prefix].append(path)
    if not kinds["face"]:
        raise RuntimeError(f"no photos under {root}; set FACES_DEV_DIR")
    return kinds


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--client-id", default=os.environ.get("FACESEARCH_CLIENT_ID", ""))
    parser.add_argument("--client-secret", default=os.environ.get("FACESEARCH_CLIENT_SECRET", ""))


class FaceSearchUser(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.photos = _photos()
        self.tasks_done = 0
        self.proof_urls: list[str] = []
        options = self.environment.parsed_options
        response = self.client.post(
            "/request-access-token",
            json={"client_id": options.client_id, "client_secret": options.client_secret},
            name="/request-access-token",
        )
        if response.status_code != 200:
            raise StopUser()
        self.headers = {"Authorization": f"Bearer {response.json()['result']['data']['token']}"}

    def _count(self) -> None:
        self.tasks_done += 1
        if self.tasks_done >= MAX_TASKS_PER_USER:
            raise StopUser()

    def _poll(self, reference_id: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + POLL_TIMEOUT_S
        while time.monotonic() < deadline:
            with self.client.post(
                "/result",
                json={"reference_id": reference_id},
                headers=self.headers,
                name="/result",
                catch_response=True,
            ) as response:
                if response.status_code == 202:
                    response.success()
                    time.sleep(0.1)
                    continue
                if response.status_code != 200:
                    response.failure(f"result {response.status_code}")
                    return None
                body: dict[str, Any] = response.json()
                return body
        events.request.fire(
            request_type="POLL",
            name="/result (timeout)",
            response_time=POLL_TIMEOUT_S * 1000,
            response_length=0,
            exception=TimeoutError(reference_id),
            context={},
        )
        return None

    def _search(self, path: Path, **fields: Any) -> None:
        subtype = "png" if path.suffix == ".png" else "jpeg"
        payload = {
            "type": "face_search",
            "file": f"data:image/{subtype};base64,{base64.b64encode(path.read_bytes()).decode()}",
            **fields,
        }
        response = self.client.post("/face-search", json=payload, headers=self.headers, name="/face-search")
        if response.status_code == 200:
            body = self._poll(response.json()["result"]["data"]["reference_id"])
            if body is not None:
                matches = body["result"]["data"]["face_search_response"]["result"]["matched_faces"]
                self.proof_urls.extend(match[2] for match in matches[:1])

    @task(2)
    def enrol(self) -> None:
        self._count()
        path = random.choice(self.photos["face"])
        self._search(path, client_reference=f"load-{path.stem}-{random.randint(0, 9)}", allow_override=1)

    @task(5)
    def search(self) -> None:
        self._count()
        self._search(random.choice(self.photos["face"] + self.photos["group"]), enroll_face=False)

    @task(3)
    def age(self) -> None:
        self._count()
        path = random.choice(self.photos["age"])
        wait = random.random() < 0.5
        files = {"file": (path.name, path.read_bytes(), "image/jpeg")}
        data = {"type": "age_estimation", "enroll_face": "0", "wait_for_result": "1" if wait else "0"}
        response = self.client.post(
            "/age-estimation", data=data, files=files, headers=self.headers, name="/age-estimation"
        )
        if response.status_code == 200 and not wait:
            self._poll(response.json()["result"]["data"]["reference_id"])

    @task(1)
    def proof(self) -> None:
        self._count()
        if self.proof_urls:
            url = self.proof_urls.pop()
            self.client.get(url.replace(self.host or "", ""), name="/get-proof/[token]")


@events.quitting.add_listener
def _report(environment: Any, **_: Any) -> None:
    stats = environment.stats.total
    p50, p99 = stats.get_response_time_percentile(0.5), stats.get_response_time_percentile(0.99)
    print(f"requests={stats.num_requests} failures={stats.num_failures} p50={p50:.0f}ms p99={p99:.0f}ms")
    if stats.num_failures:
        environment.process_exit_code = 1

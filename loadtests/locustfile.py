"""Mixed traffic against a running service: enrol, search, age estimation, result polling, proof downloads.

    FACESEARCH_CLIENT_ID=... FACESEARCH_CLIENT_SECRET=... \
    locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 2m --host http://127.0.0.1:8000

(or --client-id / --client-secret). Photos come from FACES_DEV_DIR (default ../shared/testdata/faces-dev).
Every run is bounded by -t; each simulated user also stops itself after FACESEARCH_LOAD_MAX_TASKS tasks
(default 500), and a headless run ends once every user has stopped, so a run ends even without -t.

A request counts as failed when its status is unexpected, when a result is not final within 30 s, when a
transaction ends `failed`, or when a proof URL does not serve an image. Proofs are only taken for faces
that nothing replaces (enrolled under "keep-..." references, never overridden), so every proof URL taken
must serve its image; the "load-..." references are overridden all the time to exercise replacement.
At the end one line sums it up: requests=.. failures=.. p50=..ms p99=..ms (exit code 1 on any failure).
"""

from __future__ import annotations

import base64
import functools
import itertools
import os
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import STATE_RUNNING, LocalRunner

MAX_TASKS_PER_USER = int(os.environ.get("FACESEARCH_LOAD_MAX_TASKS", "500"))
POLL_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.1
LONG_POLL_WAIT_S = 5  # users that long-poll send `Prefer: wait=5` instead of sleeping between polls
TOKEN_REFRESH_MARGIN_S = 60.0
PROOF_URLS_KEPT = 20
KEEP_PREFIX = "keep-"
_DEFAULT_PHOTOS = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "faces-dev"


@dataclass(frozen=True)
class Photo:
    name: str
    data: bytes

    @property
    def subtype(self) -> str:
        return "png" if self.name.lower().endswith(".png") else "jpeg"

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0]

    def data_uri(self) -> str:
        return f"data:image/{self.subtype};base64,{base64.b64encode(self.data).decode()}"


@functools.cache
def photos() -> dict[str, list[Photo]]:
    """Read once per process: face_* (identities), age_*, neg_* (no face), group_* (several faces)."""
    root = Path(os.environ.get("FACES_DEV_DIR", str(_DEFAULT_PHOTOS)))
    kinds: dict[str, list[Photo]] = {"face": [], "age": [], "neg": [], "group": []}
    for path in sorted(root.iterdir()):
        prefix = path.name.split("_")[0]
        if prefix in kinds and path.suffix.lower() in (".jpg", ".jpeg", ".png"):
            kinds[prefix].append(Photo(path.name, path.read_bytes()))
    if not kinds["face"] or not kinds["age"]:
        raise RuntimeError(f"no face_*/age_* photos under {root}; set FACES_DEV_DIR")
    return kinds


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--client-id", default=os.environ.get("FACESEARCH_CLIENT_ID", ""))
    parser.add_argument("--client-secret", default=os.environ.get("FACESEARCH_CLIENT_SECRET", ""))


_USER_NUMBERS = itertools.count()


class FaceSearchUser(HttpUser):
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.tasks_done = 0
        self.proof_urls: deque[str] = deque(maxlen=PROOF_URLS_KEPT)
        self.headers: dict[str, str] = {}
        self.token_expires_at = 0.0
        # Every other user long-polls /result, the rest poll on a timer: both ways real clients use.
        self.long_poll = next(_USER_NUMBERS) % 2 == 1
        self._login()

    def _login(self) -> None:
        options = self.environment.parsed_options
        with self.client.post(
            "/request-access-token",
            json={"client_id": options.client_id, "client_secret": options.client_secret},
            name="/request-access-token",
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(f"login answered {response.status_code}: {response.text[:200]}")
                raise StopUser()
            data = response.json()["result"]["data"]
        self.headers = {"Authorization": f"Bearer {data['token']}"}
        self.token_expires_at = time.monotonic() + float(data["expires_in"])

    def _begin_task(self) -> None:
        self.tasks_done += 1
        if self.tasks_done > MAX_TASKS_PER_USER:
            raise StopUser()
        if time.monotonic() > self.token_expires_at - TOKEN_REFRESH_MARGIN_S:
            self._login()  # access tokens last 15 minutes; a longer run logs in again

    def _poll(self, reference_id: str) -> dict[str, Any] | None:
        """The final result body, or None after recording why there is none."""
        deadline = time.monotonic() + POLL_TIMEOUT_S
        headers = {**self.headers, "Prefer": f"wait={LONG_POLL_WAIT_S}"} if self.long_poll else self.headers
        while time.monotonic() < deadline:
            with self.client.post(
                "/result",
                json={"reference_id": reference_id},
                headers=headers,
                name="/result (long poll)" if self.long_poll else "/result",
                catch_response=True,
            ) as response:
                if response.status_code == 202:
                    response.success()
                    if not self.long_poll:
                        gevent.sleep(POLL_INTERVAL_S)
                    continue
                if response.status_code != 200:
                    response.failure(f"result answered {response.status_code}: {response.text[:200]}")
                    return None
                body: dict[str, Any] = response.json()
                if body.get("status") is not True:
                    response.failure(f"transaction failed: {response.text[:200]}")
                    return None
                return body
        events.request.fire(
            request_type="POLL",
            name="/result (not final in time)",
            response_time=POLL_TIMEOUT_S * 1000,
            response_length=0,
            response=None,
            exception=TimeoutError(f"{reference_id} not final after {POLL_TIMEOUT_S}s"),
            context={},
        )
        return None

    def _search(self, photo: Photo, **fields: Any) -> None:
        payload = {"type": "face_search", "file": photo.data_uri(), **fields}
        with self.client.post(
            "/face-search", json=payload, headers=self.headers, name="/face-search", catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"face-search answered {response.status_code}: {response.text[:200]}")
                return
            reference_id = response.json()["result"]["data"]["reference_id"]
        body = self._poll(reference_id)
        if body is None:
            return
        matches = body["result"]["data"]["face_search_response"]["result"]["matched_faces"]
        self.proof_urls.extend(url for _, _, url, reference in matches if reference.startswith(KEEP_PREFIX))

    @task(2)
    def enrol_with_override(self) -> None:
        """Replaces the face last enrolled under one of ten references per photo."""
        self._begin_task()
        photo = random.choice(photos()["face"])
        reference = f"load-{photo.stem}-{random.randint(0, 9)}"
        self._search(photo, client_reference=reference, allow_override=1)

    @task(1)
    def enrol_and_keep(self) -> None:
        """Adds a face that is never replaced, so proof URLs that point to it must always work."""
        self._begin_task()
        photo = random.choice(photos()["face"])
        self._search(photo, client_reference=f"{KEEP_PREFIX}{photo.stem}")

    @task(5)
    def search(self) -> None:
        self._begin_task()
        kinds = photos()
        self._search(random.choice(kinds["face"] + kinds["group"] + kinds["neg"]), enroll_face=False)

    @task(3)
    def age(self) -> None:
        self._begin_task()
        photo = random.choice(photos()["age"])
        wait = random.random() < 0.5
        files = {"file": (photo.name, photo.data, f"image/{photo.subtype}")}
        data = {"type": "age_estimation", "enroll_face": "0", "wait_for_result": "1" if wait else "0"}
        with self.client.post(
            "/age-estimation",
            data=data,
            files=files,
            headers=self.headers,
            name="/age-estimation",
            catch_response=True,
        ) as response:
            if response.status_code not in (200, 202):
                response.failure(f"age-estimation answered {response.status_code}: {response.text[:200]}")
                return
            body = response.json()
            if body.get("status") is not True:
                response.failure(f"transaction failed: {response.text[:200]}")
                return
            result = body["result"]["data"]
            if response.status_code == 200 and wait and "age" not in result:
                response.failure(f"wait_for_result=1 answered 200 without the age: {response.text[:200]}")
                return
        if response.status_code == 202 or not wait:
            self._poll(result["reference_id"])

    @task(1)
    def proof(self) -> None:
        self._begin_task()
        if not self.proof_urls:
            return
        # The URL as issued (it is the credential, and carries the service's own base URL); no
        # Authorization header: proof URLs need none.
        with self.client.get(
            self.proof_urls.pop(), name="/get-proof/[token]", catch_response=True
        ) as response:
            content_type = response.headers.get("content-type", "")
            if response.status_code != 200:
                response.failure(f"proof answered {response.status_code}: {response.text[:200]}")
            elif not content_type.startswith(("image/jpeg", "image/png")) or not response.content:
                response.failure(f"proof is not an image: {content_type}, {len(response.content)} bytes")


def _stop_when_all_users_stopped(environment: Environment) -> None:
    """Users stop themselves after MAX_TASKS_PER_USER tasks; locust itself would then idle until -t."""
    runner = environment.runner
    while True:
        gevent.sleep(1.0)
        if runner is None or runner.state != STATE_RUNNING or runner.user_count > 0:
            continue
        if environment.parsed_options is not None and environment.parsed_options.headless:
            runner.quit()
        else:
            runner.stop()
        return


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, LocalRunner):
        gevent.spawn(_stop_when_all_users_stopped, environment)


@events.quitting.add_listener
def _report(environment: Environment, **_: Any) -> None:
    stats = environment.stats.total
    p50, p99 = stats.get_response_time_percentile(0.5), stats.get_response_time_percentile(0.99)
    print(f"requests={stats.num_requests} failures={stats.num_failures} p50={p50:.0f}ms p99={p99:.0f}ms")
    for entry in sorted(environment.stats.entries.values(), key=lambda entry: entry.name):
        print(
            f"  {entry.method} {entry.name}: requests={entry.num_requests} failures={entry.num_failures} "
            f"p50={entry.get_response_time_percentile(0.5):.0f}ms "
            f"p99={entry.get_response_time_percentile(0.99):.0f}ms"
        )
    for error in environment.stats.errors.values():
        print(f"failure: {error.occurrences} x {error.method} {error.name}: {error.error}")
    if stats.num_failures:
        environment.process_exit_code = 1

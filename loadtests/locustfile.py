"""Mixed traffic against a running service: enrol, search, age estimation, result polling, proof downloads.

    FACESEARCH_CLIENT_ID=... FACESEARCH_CLIENT_SECRET=... \
    locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 2m --host http://127.0.0.1:8000

(or --client-id / --client-secret). Photos come from FACES_DEV_DIR (default ../shared/testdata/faces-dev).
Every run is bounded by -t; each simulated user also stops itself after FACESEARCH_LOAD_MAX_TASKS tasks
(default 500), and a headless run ends once every user has stopped, so a run ends even without -t.

Users send through facesearch_client (login and token refresh, polling, back-off on 429/503); every HTTP
request it makes, retries included, is reported to Locust. A third of the users search in one request
(`Prefer: wait` on the create: the result in its own answer, a long poll only when it was not final in
time), a third long-poll `/result` after the create, a third poll it on a timer. A request counts as
failed when it gets an error status, when a result is not final within 30 s, when a transaction ends
`failed`, or when a proof URL does not serve an image. Proofs are only taken for faces that nothing
replaces (enrolled under "keep-..." references, never overridden), so every proof URL taken must serve its
image; the "load-..." references are overridden all the time to exercise replacement.
At the end one line sums it up: requests=.. failures=.. p50=..ms p99=..ms (exit code 1 on any failure).
"""

from __future__ import annotations

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
import httpx
from locust import User, between, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import STATE_RUNNING, LocalRunner

from facesearch_client import (
    AgeResult,
    ApiError,
    FaceSearchClient,
    FaceSearchError,
    FaceSearchResult,
    Pending,
    ResultTimeout,
    TransactionFailed,
)
from facesearch_client.models import Result

MAX_TASKS_PER_USER = int(os.environ.get("FACESEARCH_LOAD_MAX_TASKS", "500"))
POLL_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.1
LONG_POLL_WAIT_S = 5  # users that long-poll send `Prefer: wait=5` instead of sleeping between polls
# How each user waits for a search's result (users take them in turn).
ONE_REQUEST, LONG_POLL, TIMED_POLLS = "one request", "long poll", "timed polls"
STYLES = (ONE_REQUEST, LONG_POLL, TIMED_POLLS)
PROOF_URLS_KEPT = 20
KEEP_PREFIX = "keep-"
_DEFAULT_PHOTOS = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "faces-dev"


@dataclass(frozen=True)
class Photo:
    name: str
    data: bytes

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0]


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


def _endpoint(request: httpx.Request) -> str:
    """The name a request is reported under: one per endpoint, whatever its token or options."""
    path = request.url.path
    if path.startswith("/get-proof/"):
        return "/get-proof/[token]"
    if path == "/result" and "prefer" in request.headers:
        return "/result (long poll)"
    if path == "/face-search" and "prefer" in request.headers:
        return "/face-search (Prefer: wait)"
    return path


class LocustTransport(httpx.BaseTransport):
    """Reports every request the client sends (retries included) to Locust: its time, size and, for an
    HTTP error status, a failure."""

    def __init__(self, environment: Environment) -> None:
        self._environment = environment
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        started = time.perf_counter()
        exception: BaseException | None = None
        length = 0
        try:
            response = self._inner.handle_request(request)
            length = len(response.read())
            if response.status_code >= 400:
                exception = RuntimeError(f"answered {response.status_code}: {response.text[:200]}")
            return response
        except httpx.TransportError as error:
            exception = error
            raise
        finally:
            self._environment.events.request.fire(
                request_type=request.method,
                name=_endpoint(request),
                response_time=(time.perf_counter() - started) * 1000,
                response_length=length,
                response=None,
                exception=exception,
                context={},
            )

    def close(self) -> None:
        self._inner.close()


class FaceSearchUser(User):
    """Drives the service through facesearch_client (login and token refresh, polling, back-off)."""

    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.tasks_done = 0
        self.proof_urls: deque[str] = deque(maxlen=PROOF_URLS_KEPT)
        # Every way real clients wait for a result: one request, long polls, polls on a timer.
        self.style = STYLES[next(_USER_NUMBERS) % len(STYLES)]
        self.long_poll_s = None if self.style == TIMED_POLLS else LONG_POLL_WAIT_S
        options = self.environment.parsed_options
        http = httpx.Client(base_url=self.host or "", transport=LocustTransport(self.environment), timeout=60)
        self.api = FaceSearchClient(
            client_id=options.client_id, client_secret=options.client_secret, http=http
        )
        try:
            self.api.login()
        except FaceSearchError:
            raise StopUser() from None

    def on_stop(self) -> None:
        self.api.close()

    def _begin_task(self) -> None:
        self.tasks_done += 1
        if self.tasks_done > MAX_TASKS_PER_USER:
            raise StopUser()

    def _failed(self, name: str, error: BaseException) -> None:
        """A failure no single request shows: a transaction that failed or did not finish in time."""
        self.environment.events.request.fire(
            request_type="TRANSACTION",
            name=name,
            response_time=0,
            response_length=0,
            response=None,
            exception=error,
            context={},
        )

    def _wait(self, reference_id: str) -> Result | None:
        try:
            return self.api.wait(reference_id, POLL_TIMEOUT_S, long_poll_s=self.long_poll_s)
        except ResultTimeout as error:
            self._failed("/result (not final in time)", error)
        except TransactionFailed as error:
            self._failed("transaction failed", error)
        except ApiError:
            pass  # the transport reported the failed request already
        return None

    def _search(self, photo: Photo, **options: Any) -> None:
        answer: Result | str | None
        try:
            if self.style == ONE_REQUEST:
                answer = self.api.face_search(
                    photo.data, wait_s=LONG_POLL_WAIT_S, as_json=True, filename=photo.name, **options
                )
            else:
                answer = self.api.submit_face_search(photo.data, as_json=True, filename=photo.name, **options)
        except TransactionFailed as error:
            self._failed("transaction failed", error)
            return
        except ApiError:
            return  # reported by the transport
        result = self._wait(answer) if isinstance(answer, str) else answer
        if isinstance(result, FaceSearchResult):
            self.proof_urls.extend(
                match.proof_url for match in result.matches if match.client_reference.startswith(KEEP_PREFIX)
            )

    @task(2)
    def enrol_with_override(self) -> None:
        """Replaces the face last enrolled under one of ten references per photo."""
        self._begin_task()
        photo = random.choice(photos()["face"])
        reference = f"load-{photo.stem}-{random.randint(0, 9)}"
        self._search(photo, client_reference=reference, allow_override=True)

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
        try:
            if random.random() < 0.5:
                answer = self.api.age_estimation(photo.data, enroll_face=False)
                if isinstance(answer, AgeResult) and "age" not in answer.raw:
                    self._failed(
                        "/age-estimation", RuntimeError("wait_for_result=1 answered without the age")
                    )
                    return
                if isinstance(answer, Pending):
                    self._wait(answer.reference_id)
            else:
                self._wait(self.api.submit_age_estimation(photo.data, enroll_face=False))
        except TransactionFailed as error:
            self._failed("transaction failed", error)
        except ApiError:
            pass  # reported by the transport

    @task(1)
    def proof(self) -> None:
        self._begin_task()
        if not self.proof_urls:
            return
        # The URL as issued (it is the credential, and carries the service's own base URL); no
        # Authorization header: proof URLs need none.
        try:
            image = self.api.proof(self.proof_urls.pop())
        except ApiError:
            return  # reported by the transport
        if not image.startswith((b"\xff\xd8", b"\x89PNG")):
            self._failed("/get-proof/[token]", RuntimeError(f"proof is not an image ({len(image)} bytes)"))


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

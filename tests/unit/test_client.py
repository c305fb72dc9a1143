"""facesearch_client against httpx.MockTransport: a scripted service, so login, refresh, retries and
parsing are checked request by request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from facesearch_client import (
    AgeResult,
    ApiError,
    AsyncFaceSearchClient,
    AuthenticationError,
    FaceSearchClient,
    FaceSearchResult,
    Pending,
    RetriesExhausted,
    RetryPolicy,
    TransactionFailed,
)
from tests.unit.fakes import ManualClock

CLIENT_ID = "cl_" + "a" * 24
SECRET = "s3cret"
REF = "0" * 32
SEARCH_DATA = {
    "service_reference_id": REF,
    "client_reference": "customer-1",
    "face_search_response": {
        "result": {
            "matched_faces": [["f" + "1" * 32, 0.91, "http://x/get-proof/t", "customer-9"]],
            "is_face_found": True,
        }
    },
}


def envelope(data: dict[str, Any], status: bool = True) -> dict[str, Any]:
    return {"status": status, "message": "ok", "result": {"data": data}}


def error(message: str) -> dict[str, Any]:
    return {"status": False, "message": message, "errors": {}}


class Service:
    """A scripted service: records every request; `answers` maps a path to a queue of responses."""

    def __init__(self, expires_in: int = 900) -> None:
        self.requests: list[httpx.Request] = []
        # An exception in the queue is raised by the transport instead of an answer (a broken connection).
        self.answers: dict[str, list[httpx.Response | Exception]] = {}
        self.logins = 0
        self.expires_in = expires_in

    def queue(self, path: str, *responses: httpx.Response | Exception) -> None:
        self.answers.setdefault(path, []).extend(responses)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/request-access-token" and not self.answers.get(request.url.path):
            self.logins += 1
            body = json.loads(request.content)
            assert body == {"client_id": CLIENT_ID, "client_secret": SECRET}
            data = {"token": f"token-{self.logins}", "token_type": "Bearer", "expires_in": self.expires_in}
            return httpx.Response(200, json=envelope(data))
        answer = self.answers[request.url.path].pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sent(self, path: str) -> list[httpx.Request]:
        return [request for request in self.requests if request.url.path == path]


def client(
    service: Service, *, mode: str = "token", clock: Callable[[], float] | None = None, **options: Any
) -> tuple[FaceSearchClient, list[float]]:
    slept: list[float] = []
    http = httpx.Client(base_url="http://service", transport=httpx.MockTransport(service))
    extra: dict[str, Any] = {"clock": clock} if clock is not None else {}
    return (
        FaceSearchClient(
            client_id=CLIENT_ID,
            client_secret=SECRET,
            mode=mode,
            http=http,
            sleep=slept.append,
            **extra,
            **options,
        ),
        slept,
    )


def test_login_once_then_bearer_and_refresh_before_expiry() -> None:
    service = Service(expires_in=300)
    clock = ManualClock()
    api, _ = client(service, clock=clock)
    service.queue("/result", *(httpx.Response(200, json=envelope(SEARCH_DATA)) for _ in range(3)))
    api.result(REF)
    api.result(REF)
    assert service.logins == 1
    clock.advance(300 - 29)  # inside the 30 s refresh margin: log in again before the token expires
    api.result(REF)
    assert service.logins == 2
    assert [r.headers["authorization"] for r in service.sent("/result")] == [
        "Bearer token-1",
        "Bearer token-1",
        "Bearer token-2",
    ]


def test_a_401_logs_in_again_once() -> None:
    service = Service()
    api, _ = client(service)
    service.queue(
        "/result", httpx.Response(401, json=error("revoked")), httpx.Response(200, json=envelope(SEARCH_DATA))
    )
    assert isinstance(api.result(REF), FaceSearchResult)
    assert service.logins == 2
    service.queue(
        "/result", httpx.Response(401, json=error("no")), httpx.Response(401, json=error("still no"))
    )
    with pytest.raises(AuthenticationError):
        api.result(REF)


def test_client_secret_mode_never_logs_in() -> None:
    service = Service()
    api, _ = client(service, mode="secret")
    service.queue(
        "/gallery/stats",
        httpx.Response(
            200,
            json=envelope(
                {
                    "faces": 3,
                    "client_references": 2,
                    "model_version": "v2",
                    "oldest_enrolment": None,
                    "newest_enrolment": None,
                }
            ),
        ),
    )
    assert api.gallery_stats().faces == 3
    assert service.logins == 0
    (request,) = service.sent("/gallery/stats")
    assert request.headers["client-secret"] == SECRET and "authorization" not in request.headers


def test_429_and_503_honour_retry_after_and_give_up_after_the_bound() -> None:
    service = Service()
    api, slept = client(service, retry=RetryPolicy(max_retries=3, base_s=0.5, max_wait_s=20))
    service.queue(
        "/result",
        httpx.Response(429, json=error("slow down"), headers={"Retry-After": "7"}),
        httpx.Response(503, json=error("unavailable")),  # no Retry-After: exponential from base_s
        httpx.Response(503, json=error("unavailable"), headers={"Retry-After": "120"}),  # capped
        httpx.Response(200, json=envelope(SEARCH_DATA)),
    )
    assert isinstance(api.result(REF), FaceSearchResult)
    assert slept == [7.0, 1.0, 20.0]
    service.queue(
        "/result", *(httpx.Response(429, json=error("no"), headers={"Retry-After": "1"}) for _ in range(4))
    )
    with pytest.raises(RetriesExhausted) as raised:
        api.result(REF)
    assert raised.value.status_code == 429
    assert len(service.sent("/result")) == 4 + 4  # the bound: one try and three retries


def test_a_create_whose_connection_broke_is_sent_again_with_its_key_and_other_calls_are_not() -> None:
    """A replica that dies while receiving a create leaves the client with a broken connection and no
    answer: the create may exist. Sent again with its Idempotency-Key it is created at most once, so the
    client resends it; a deletion is not repeatable and the error reaches the caller. A refused connection
    reached nothing, so any call goes again."""
    service = Service()
    api, slept = client(service, retry=RetryPolicy(max_retries=3, base_s=0.5))
    created = httpx.Response(200, json=envelope({"reference_id": REF}))
    broken = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    service.queue("/face-search", broken, httpx.ReadError("connection reset"), created)
    assert api.submit_face_search(b"\xff\xd8 jpeg") == REF
    keys = {request.headers["idempotency-key"] for request in service.sent("/face-search")}
    assert len(service.sent("/face-search")) == 3 and len(keys) == 1
    assert slept == [0.5, 1.0]

    service.queue("/gallery/faces/f" + "1" * 32, httpx.ReadError("connection reset"))
    with pytest.raises(httpx.ReadError):
        api.delete_face("f" + "1" * 32)
    service.queue(
        "/gallery/faces/f" + "2" * 32,
        httpx.ConnectError("refused"),
        httpx.Response(200, json=envelope({"face_id": "f" + "2" * 32, "deleted": True})),
    )
    api.delete_face("f" + "2" * 32)
    assert len(service.sent("/gallery/faces/f" + "2" * 32)) == 2

    service.queue("/result", *(httpx.ReadTimeout("slow") for _ in range(2)))
    with pytest.raises(httpx.ReadTimeout):  # a timeout is the caller's budget: not resent
        api.result(REF)
    assert len(service.sent("/result")) == 1


def test_send_returns_the_last_answer_once_retries_are_spent() -> None:
    from facesearch_client import calls

    service = Service()
    api, slept = client(service, retry=RetryPolicy(max_retries=0))
    service.queue("/result", httpx.Response(503, json=error("down"), headers={"Retry-After": "5"}))
    assert api.send(calls.result(REF)).status_code == 503
    assert slept == []


def test_long_polling_sends_prefer_wait_until_final() -> None:
    service = Service()
    api, slept = client(service)
    pending = httpx.Response(202, json=envelope({"reference_id": REF, "state": "processing"}))
    service.queue("/result", pending, httpx.Response(200, json=envelope(SEARCH_DATA)))
    result = api.wait(REF, timeout_s=60, long_poll_s=10)
    assert isinstance(result, FaceSearchResult)
    assert [r.headers["prefer"] for r in service.sent("/result")] == ["wait=10", "wait=10"]
    assert slept == []  # a long poll needs no sleep between polls
    assert result.matches[0].client_reference == "customer-9" and result.matches[0].score == 0.91
    assert result.client_reference == "customer-1" and result.is_face_found


def test_short_polling_and_a_failed_transaction() -> None:
    service = Service()
    api, slept = client(service)
    failed = {
        "status": False,
        "message": "The transaction failed: bad image",
        "errors": {"transaction": "x"},
        "result": {"data": {"reference_id": REF, "state": "failed"}},
    }
    service.queue(
        "/result",
        httpx.Response(202, json=envelope({"reference_id": REF, "state": "queued"})),
        httpx.Response(200, json=failed),
    )
    with pytest.raises(TransactionFailed):
        api.wait(REF, long_poll_s=None)
    assert "prefer" not in service.sent("/result")[0].headers
    assert slept == [0.05]


def test_a_search_is_one_request_when_the_result_is_ready_in_time() -> None:
    service = Service()
    api, slept = client(service)
    service.queue(
        "/face-search",
        httpx.Response(503, json=error("down"), headers={"Retry-After": "1"}),
        httpx.Response(200, json=envelope(SEARCH_DATA)),
    )
    result = api.search(b"\xff\xd8 jpeg", client_reference="customer-1")
    assert isinstance(result, FaceSearchResult) and result.reference_id == REF
    assert result.matches[0].client_reference == "customer-9"
    assert service.sent("/result") == []  # the create's own answer carried the result
    first, retry = service.sent("/face-search")
    assert first.headers["prefer"] == retry.headers["prefer"] == "wait=10"
    # The retry is the same logical request: the service answers it with the same transaction's result.
    assert first.headers["idempotency-key"] == retry.headers["idempotency-key"]
    assert slept == [1.0]


def test_face_search_answers_the_reference_when_not_final_in_time_and_raises_for_a_failed_one() -> None:
    service = Service()
    api, _ = client(service)
    failed = {
        "status": False,
        "message": "The transaction failed: bad image",
        "errors": {"transaction": "x"},
        "result": {"data": {"reference_id": REF, "state": "failed"}},
    }
    service.queue(
        "/face-search",
        httpx.Response(200, json=envelope({"reference_id": REF})),
        httpx.Response(200, json=failed),
    )
    assert api.face_search(b"\xff\xd8 jpeg", wait_s=3) == REF
    assert service.sent("/face-search")[0].headers["prefer"] == "wait=3"
    with pytest.raises(TransactionFailed):
        api.face_search(b"\xff\xd8 jpeg")


def test_requests_are_shaped_as_the_interface_says(tmp_path: Any) -> None:
    service = Service()
    api, _ = client(service)
    photo = tmp_path / "face.png"
    photo.write_bytes(b"\x89PNG fake")
    created = httpx.Response(200, json=envelope({"reference_id": REF}))
    service.queue("/face-search", created, created)
    api.submit_face_search(photo, client_reference="customer-1", allow_override=True)
    api.submit_face_search(photo, enroll_face=False, as_json=True)
    multipart, as_json = service.sent("/face-search")
    assert multipart.headers["content-type"].startswith("multipart/form-data")
    assert b'name="allow_override"\r\n\r\n1' in multipart.content and b"\x89PNG fake" in multipart.content
    body = json.loads(as_json.content)
    assert body["type"] == "face_search" and body["enroll_face"] == "0"
    assert body["file"].startswith("data:image/png;base64,")

    age = {"reference_id": REF, "age": 34, "under_18": 0, "under_21": 0}
    service.queue("/age-estimation", httpx.Response(200, json=envelope(age)))
    assert api.age_estimation(b"\xff\xd8 jpeg") == AgeResult(REF, 34, 0, 0, raw=age)
    assert b'name="wait_for_result"\r\n\r\n1' in service.sent("/age-estimation")[0].content
    # Bytes get a file name with their format's extension (the service checks it).
    assert b'filename="image.jpg"' in service.sent("/age-estimation")[0].content

    page = {
        "faces": [
            {
                "face_id": "f" + "2" * 32,
                "client_reference": "c-1",
                "enrolled_at": "2026-11-23T18:52:07Z",
                "model_version": "v2",
                "proof_url": "http://x/get-proof/t",
            }
        ],
        "next_cursor": "abc",
    }
    last: dict[str, object] = {"faces": [], "next_cursor": None}
    service.queue(
        "/gallery/faces", httpx.Response(200, json=envelope(page)), httpx.Response(200, json=envelope(last))
    )
    assert [face.client_reference for face in api.iter_faces(page_size=1)] == ["c-1"]
    assert service.sent("/gallery/faces")[1].url.params["cursor"] == "abc"
    service.queue(
        "/gallery/erasures",
        httpx.Response(
            422, json={"status": False, "message": "bad", "errors": {"client_reference": "length"}}
        ),
    )
    with pytest.raises(ApiError) as raised:
        api.erase("abc")
    assert getattr(raised.value, "errors", None) == {"client_reference": "length"}


def queue_a_search_through_an_outage_and_an_expiry(service: Service) -> None:
    """A face search answered 503 (Retry-After: 2) once, then a result poll answered 401 (a new login),
    202 and the result."""
    service.queue(
        "/face-search",
        httpx.Response(503, json=error("down"), headers={"Retry-After": "2"}),
        httpx.Response(200, json=envelope({"reference_id": REF})),
    )
    service.queue(
        "/result",
        httpx.Response(401, json=error("expired")),
        httpx.Response(202, json=envelope({"reference_id": REF, "state": "queued"})),
        httpx.Response(200, json=envelope(SEARCH_DATA)),
    )


def test_async_client_does_the_same() -> None:
    async def scenario() -> None:
        service = Service()
        slept: list[float] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        http = httpx.AsyncClient(base_url="http://service", transport=httpx.MockTransport(service))
        async with AsyncFaceSearchClient(
            client_id=CLIENT_ID, client_secret=SECRET, http=http, sleep=sleep
        ) as api:
            queue_a_search_through_an_outage_and_an_expiry(service)
            result = await api.search(b"\xff\xd8 jpeg", client_reference="customer-1")
            assert isinstance(result, FaceSearchResult) and result.reference_id == REF
            assert slept == [2.0]
            assert service.logins == 2
            # Created but not final within the create's wait: then long polls of /result.
            assert service.sent("/face-search")[-1].headers["prefer"] == "wait=10"
            assert [poll.headers["prefer"] for poll in service.sent("/result")] == ["wait=10"] * 3
            service.queue(
                "/result", httpx.Response(202, json=envelope({"reference_id": REF, "state": "queued"}))
            )
            assert await api.result(REF, wait_s=2) == Pending(REF, "queued")
            assert service.sent("/result")[-1].headers["prefer"] == "wait=2"
        await http.aclose()

    asyncio.run(scenario())

"""The interface end to end over HTTP against the real application and real photos."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from facesearch_client import calls
from tests.faces_dev import FacesDev
from tests.integration.api_client import (
    age_estimation,
    auth,
    client_for,
    data_uri,
    face_search_json,
    face_search_multipart,
    reference_of,
    wait_result,
)
from tests.service_harness import RunningService

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def token(service: RunningService) -> str:
    return service.token_for(service.new_client("api-tests"))


@pytest.fixture(scope="module")
def http(service: RunningService) -> Iterator[httpx.Client]:
    with service.http() as client:
        yield client


def reference_for(identity: str) -> str:
    return f"ref-{identity}"


@pytest.fixture(scope="module")
def enrolled(http: httpx.Client, token: str, faces_dev: FacesDev) -> dict[str, str]:
    """First photo of each of the 10 identities enrolled under its own client_reference."""
    references = {}
    for number, (identity, photos) in enumerate(faces_dev.by_identity().items()):
        send = face_search_json if number % 2 else face_search_multipart
        reference_id = reference_of(
            send(http, token, photos[0].path, client_reference=reference_for(identity))
        )
        references[identity] = reference_id
    for reference_id in references.values():
        result = wait_result(http, token, reference_id)
        assert result["result"]["data"]["face_search_response"]["result"]["is_face_found"] is True
    return references


def test_token_endpoint_shape(service: RunningService) -> None:
    client = service.new_client("shape")
    with service.http() as http:
        response = http.post(
            "/request-access-token",
            data={"client_id": client.client_id, "client_secret": client.client_secret},
        )
    assert response.status_code == 200
    body = response.json()
    assert body["status"] is True
    assert body["result"]["data"]["expires_in"] == service.settings.auth.access_token_ttl_s
    assert body["result"]["data"]["token"].count(".") == 2


def test_search_finds_each_identity_first(
    http: httpx.Client, token: str, faces_dev: FacesDev, enrolled: dict[str, str]
) -> None:
    for identity, photos in faces_dev.by_identity().items():
        reference_id = reference_of(face_search_json(http, token, photos[1].path, enroll_face=False))
        data = wait_result(http, token, reference_id)["result"]["data"]
        assert data["service_reference_id"] == reference_id
        result = data["face_search_response"]["result"]
        assert result["is_face_found"] is True
        assert result["matched_faces"], f"no match for {identity}"
        best = result["matched_faces"][0]
        assert best[3] == reference_for(identity)
        assert 0.5 <= best[1] <= 1.0
        scores = [match[1] for match in result["matched_faces"]]
        assert scores == sorted(scores, reverse=True)


def test_first_enrolment_does_not_match_itself(
    http: httpx.Client, token: str, enrolled: dict[str, str]
) -> None:
    for reference_id in enrolled.values():
        matched = wait_result(http, token, reference_id)["result"]["data"]["face_search_response"]["result"]
        assert all(match[0] != f"f{reference_id}" for match in matched["matched_faces"])


def test_proof_url_serves_the_enrolled_image(
    http: httpx.Client, token: str, faces_dev: FacesDev, enrolled: dict[str, str]
) -> None:
    photos = next(iter(faces_dev.by_identity().values()))
    reference_id = reference_of(face_search_json(http, token, photos[2].path, enroll_face=False))
    best = wait_result(http, token, reference_id)["result"]["data"]["face_search_response"]["result"][
        "matched_faces"
    ][0]
    proof_url = best[2]
    assert proof_url.startswith(http.base_url.__str__().rstrip("/") + "/get-proof/")
    proof = httpx.get(proof_url)
    assert proof.status_code == 200
    assert proof.headers["content-type"] in ("image/jpeg", "image/png")
    assert proof.content == photos[0].path.read_bytes()
    tampered = proof_url[:-3] + ("aaa" if not proof_url.endswith("aaa") else "bbb")
    refused = httpx.get(tampered)
    assert refused.status_code == 404
    assert refused.json()["status"] is False


def test_no_face_photo(http: httpx.Client, token: str, faces_dev: FacesDev) -> None:
    negative = faces_dev.of_kind("negative")[0]
    data = wait_result(http, token, reference_of(face_search_multipart(http, token, negative.path)))[
        "result"
    ]["data"]
    assert data["face_search_response"]["result"] == {"matched_faces": [], "is_face_found": False}


def test_age_estimation_wait_and_poll(http: httpx.Client, token: str, faces_dev: FacesDev) -> None:
    photo = faces_dev.of_kind("age")[0]
    waited = age_estimation(http, token, photo.path, wait_for_result=1, enroll_face=0)
    assert waited.status_code == 200, waited.text
    data = waited.json()["result"]["data"]
    assert isinstance(data["age"], int) and 0 <= data["age"] <= 100
    assert data["under_18"] in (0, 50, 100) and data["under_21"] in (0, 50, 100)
    assert data["under_21"] >= data["under_18"]
    polled = wait_result(http, token, reference_of(age_estimation(http, token, photo.path, enroll_face=0)))
    assert polled["result"]["data"]["age"] == data["age"]
    # age_decision (an extension) appears exactly when a flag is 50.
    extension = {"age_decision"} if 50 in (data["under_18"], data["under_21"]) else set()
    assert set(polled["result"]["data"]) == {"reference_id", "age", "under_18", "under_21"} | extension


def test_result_long_poll_answers_once_final(http: httpx.Client, token: str, faces_dev: FacesDev) -> None:
    photo = faces_dev.of_kind("identity")[0]
    reference_id = reference_of(face_search_json(http, token, photo.path, enroll_face=False))
    response = http.post(
        "/result", headers={**auth(token), "Prefer": "wait=10"}, json={"reference_id": reference_id}
    )
    # One request, no 202: the service held it until the transaction was final.
    assert response.status_code == 200, response.text
    assert response.headers["Preference-Applied"] == "wait=10"
    data = response.json()["result"]["data"]
    assert data["service_reference_id"] == reference_id
    assert data["face_search_response"]["result"]["is_face_found"] is True


def test_a_face_search_in_one_request_and_its_keyed_retry_answer_the_same_result(
    http: httpx.Client, token: str, faces_dev: FacesDev, enrolled: dict[str, str]
) -> None:
    identity, photos = next(iter(faces_dev.by_identity().items()))
    # One logical request (one Idempotency-Key) sent twice, as a client retries one whose answer was lost.
    call = calls.face_search(
        photos[1].path, as_json=True, enroll_face=False, wait_s=10, idempotency_key=f"one-request-{identity}"
    )
    first, again = client_for(http, token).send(call), client_for(http, token).send(call)
    # No 202 and no /result: the create's own answer is the result.
    assert first.status_code == again.status_code == 200, first.text
    assert first.headers["Preference-Applied"] == again.headers["Preference-Applied"] == "wait=10"
    data = first.json()["result"]["data"]
    result = data["face_search_response"]["result"]
    assert result["is_face_found"] is True and result["matched_faces"][0][3] == reference_for(identity)
    assert again.json()["result"]["data"]["service_reference_id"] == data["service_reference_id"]
    # The transaction's own result (proof URLs aside: they are minted afresh at each read).
    read = wait_result(http, token, data["service_reference_id"])["result"]["data"]
    matches = read["face_search_response"]["result"]["matched_faces"]
    assert [match[:2] + match[3:] for match in matches] == [
        match[:2] + match[3:] for match in result["matched_faces"]
    ]


def test_age_estimation_without_face_is_null(http: httpx.Client, token: str, faces_dev: FacesDev) -> None:
    negative = faces_dev.of_kind("negative")[1]
    data = age_estimation(http, token, negative.path, wait_for_result=1).json()["result"]["data"]
    assert data["age"] is None and data["under_18"] is None and data["under_21"] is None


def test_override_replaces_latest_image(
    http: httpx.Client, token: str, faces_dev: FacesDev, enrolled: dict[str, str]
) -> None:
    identities = list(faces_dev.by_identity().values())
    first, second = identities[0], identities[1]
    reference = "override-subject"
    wait_result(
        http, token, reference_of(face_search_json(http, token, first[2].path, client_reference=reference))
    )
    replaced = face_search_json(http, token, second[2].path, client_reference=reference, allow_override=1)
    wait_result(http, token, reference_of(replaced))

    def references_matching(photo_path: Path) -> list[str]:
        reference_id = reference_of(face_search_json(http, token, photo_path, enroll_face=False))
        result = wait_result(http, token, reference_id)["result"]["data"]["face_search_response"]["result"]
        return [match[3] for match in result["matched_faces"]]

    assert reference in references_matching(second[1].path)
    assert reference not in references_matching(first[1].path)


def test_other_tenant_cannot_read_results(
    service: RunningService, http: httpx.Client, token: str, faces_dev: FacesDev, enrolled: dict[str, str]
) -> None:
    other = service.token_for(service.new_client("other-tenant"))
    reference_id = next(iter(enrolled.values()))
    response = http.post("/result", headers=auth(other), json={"reference_id": reference_id})
    assert response.status_code == 422
    # The other tenant's gallery is empty: the same face finds nothing there.
    photo = next(iter(faces_dev.by_identity().values()))[1]
    data = wait_result(
        http, other, reference_of(face_search_json(http, other, photo.path, enroll_face=False))
    )
    assert data["result"]["data"]["face_search_response"]["result"]["matched_faces"] == []


def test_client_secret_header_alternative(service: RunningService, http: httpx.Client) -> None:
    client = service.new_client("header")
    response = http.post(
        "/result", headers={"Client-Secret": client.client_secret}, json={"reference_id": "x" * 32}
    )
    assert response.status_code == 422  # authenticated; the reference is simply unknown
    wrong = http.post("/result", headers={"Client-Secret": "not-a-secret"}, json={"reference_id": "x" * 32})
    assert wrong.status_code == 401


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (90, 120, 150)).save(buffer, "PNG")
    return buffer.getvalue()


VALIDATION_CASES = [
    ("missing type", {"file": "PNG"}, 422, "type"),
    ("wrong type", {"type": "age_estimation", "file": "PNG"}, 422, "type"),
    ("plain base64", {"type": "face_search", "file": "RAW"}, 422, "file"),
    ("invalid base64", {"type": "face_search", "file": "data:image/png;base64,@@@"}, 422, "file"),
    ("non-image data uri", {"type": "face_search", "file": "data:image/gif;base64,R0lGODlh"}, 415, "file"),
    (
        "client_reference 4 chars",
        {"type": "face_search", "file": "PNG", "client_reference": "abcd"},
        422,
        "client_reference",
    ),
    (
        "client_reference 256 chars",
        {"type": "face_search", "file": "PNG", "client_reference": "a" * 256},
        422,
        "client_reference",
    ),
    (
        "override without reference",
        {"type": "face_search", "file": "PNG", "allow_override": 1},
        422,
        "client_reference",
    ),
    ("override = 2", {"type": "face_search", "file": "PNG", "allow_override": 2}, 422, "allow_override"),
    (
        "enroll_face = maybe",
        {"type": "face_search", "file": "PNG", "enroll_face": "maybe"},
        422,
        "enroll_face",
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "status", "field"), VALIDATION_CASES, ids=[case[0] for case in VALIDATION_CASES]
)
def test_face_search_validation(
    http: httpx.Client, token: str, name: str, body: dict[str, object], status: int, field: str
) -> None:
    png = _png_bytes()
    filled = dict(body)
    if filled.get("file") == "PNG":
        filled["file"] = "data:image/png;base64," + base64.b64encode(png).decode()
    elif filled.get("file") == "RAW":
        filled["file"] = base64.b64encode(png).decode()
    response = http.post("/face-search", headers=auth(token), json=filled)
    assert response.status_code == status, response.text
    body_json = response.json()
    assert body_json["status"] is False and field in body_json["errors"]


def test_result_requires_valid_reference(http: httpx.Client, token: str) -> None:
    for payload in ({}, {"reference_id": ""}, {"reference_id": "does-not-exist"}):
        response = http.post("/result", headers=auth(token), json=payload)
        assert response.status_code == 422
        assert response.json()["status"] is False


def test_authentication_required(http: httpx.Client, faces_dev: FacesDev) -> None:
    photo = faces_dev.of_kind("identity")[0].path
    assert http.post("/face-search", json={"type": "face_search", "file": data_uri(photo)}).status_code == 401
    bad = http.post("/result", headers={"Authorization": "Bearer nope"}, json={"reference_id": "x"})
    assert bad.status_code == 401 and bad.json()["status"] is False


def test_openapi_documents_the_interface(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    for path in (
        "/request-access-token",
        "/face-search",
        "/age-estimation",
        "/result",
        "/get-proof/{proof_token}",
    ):
        assert path in schema["paths"]
    face_search = schema["paths"]["/face-search"]["post"]
    assert set(face_search["requestBody"]["content"]) == {"application/json", "multipart/form-data"}


FACESEARCH_METRICS = {
    "ray_facesearch_batch_requests",
    "ray_facesearch_batch_faces",
    "ray_facesearch_stage_seconds",
    "ray_facesearch_queue_depth",
    "ray_facesearch_worker_in_flight",
    "ray_facesearch_transactions",
    "ray_facesearch_transaction_seconds",
}


def scrape(metrics_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample on Ray's Prometheus endpoint, keyed by name and labels (Ray's own labels dropped)."""
    own_labels = {"stage", "state", "le"}
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            labels = frozenset((key, value) for key, value in sample.labels.items() if key in own_labels)
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def test_custom_metrics_reach_prometheus_endpoint(
    service: RunningService, http: httpx.Client, token: str, faces_dev: FacesDev
) -> None:
    photo = faces_dev.of_kind("identity")[0].path
    assert age_estimation(http, token, photo, wait_for_result="1").status_code == 200
    analysis = frozenset({("stage", "analysis")})
    completed = frozenset({("state", "completed")})
    # Ray's metrics agent exports every few seconds; the worker reports queue state every 5 s.
    deadline = time.monotonic() + 90
    while True:
        samples = scrape(service.metrics_url)
        names = {
            name.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket") for name, _ in samples
        }
        reported = (
            names >= FACESEARCH_METRICS
            and samples.get(("ray_facesearch_stage_seconds_count", analysis), 0) >= 1
            # Ray exports histogram sums from bucket midpoints: check the bucket the one face fell in.
            and samples.get(("ray_facesearch_batch_faces_bucket", analysis | {("le", "1.0")}), 0) >= 1
            and samples.get(("ray_facesearch_transactions", completed), 0) >= 1
            and samples.get(("ray_facesearch_transaction_seconds_count", frozenset()), 0) >= 1
        )
        if reported:
            break
        assert time.monotonic() < deadline, (
            f"missing: {sorted(FACESEARCH_METRICS - names)}; "
            f"reported: {sorted((k, v) for k, v in samples.items() if 'facesearch' in k[0])}"
        )
        time.sleep(2)


def test_result_with_internal_key_names_is_422_through_the_service(http: httpx.Client, token: str) -> None:
    """Issue 10: "counts" answered 500 and "queue" 503 with Redis's WRONGTYPE text."""
    for value in ("counts", "queue", "tx:queue", "sys:tx-queue"):
        response = http.post("/result", headers=auth(token), json={"reference_id": value})
        assert response.status_code == 422, (value, response.text)
        assert set(response.json()["errors"]) == {"reference_id"}
        assert "WRONGTYPE" not in response.text


def test_forwarded_for_from_loopback_does_not_choose_the_login_bucket(service: RunningService) -> None:
    """No trusted proxies: X-Forwarded-For from 127.0.0.1 is not believed, not even by the uvicorn inside
    Ray's HTTP proxy (which trusts 127.0.0.1 by default), so rotating it does not buy fresh attempts."""
    client = service.new_client("xff")
    allowance = service.settings.auth.login_failures_per_window
    with service.http() as http:
        statuses = [
            http.post(
                "/request-access-token",
                json={"client_id": client.client_id, "client_secret": "wrong"},
                headers={"X-Forwarded-For": f"198.51.100.{n}"},
            ).status_code
            for n in range(allowance + 1)
        ]
    assert statuses == [401] * allowance + [429], statuses

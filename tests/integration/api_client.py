"""Small HTTP helpers for tests that drive the running service. The requests are built and sent by
facesearch_client (the project's client library) with retries off, so a test sees every answer as the
service gave it; tests of malformed requests use raw httpx instead."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import httpx

from facesearch_client import FaceSearchClient, RetryPolicy, calls

NO_RETRIES = RetryPolicy(max_retries=0)


def data_uri(path: Path) -> str:
    subtype = "png" if path.suffix.lower() == ".png" else "jpeg"
    return f"data:image/{subtype};base64,{base64.b64encode(path.read_bytes()).decode()}"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def client_for(http: httpx.Client, token: str) -> FaceSearchClient:
    """The client library over the test's own httpx.Client, with this access token and no retries."""
    return FaceSearchClient(token=token, http=http, retry=NO_RETRIES)


def face_search_json(http: httpx.Client, token: str, path: Path, **fields: Any) -> httpx.Response:
    return client_for(http, token).send(calls.face_search(path, as_json=True, extra=fields))


def face_search_multipart(http: httpx.Client, token: str, path: Path, **fields: Any) -> httpx.Response:
    return client_for(http, token).send(calls.face_search(path, extra=fields))


def age_estimation(http: httpx.Client, token: str, path: Path, **fields: Any) -> httpx.Response:
    return client_for(http, token).send(calls.age_estimation(path, extra=fields))


def reference_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] is True
    return str(body["result"]["data"]["reference_id"])


def wait_result(http: httpx.Client, token: str, reference_id: str, timeout_s: float = 120) -> dict[str, Any]:
    """Poll /result until it is final (200); 202 means not final yet."""
    client = client_for(http, token)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.send(calls.result(reference_id))
        if response.status_code == 200:
            body: dict[str, Any] = response.json()
            return body
        assert response.status_code == 202, response.text
        assert response.json()["result"]["data"]["state"] in ("queued", "processing")
        time.sleep(0.2)
    raise TimeoutError(f"transaction {reference_id} not final after {timeout_s}s")

"""Small HTTP helpers for tests that drive the running service."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import httpx


def data_uri(path: Path) -> str:
    subtype = "png" if path.suffix.lower() == ".png" else "jpeg"
    return f"data:image/{subtype};base64,{base64.b64encode(path.read_bytes()).decode()}"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def face_search_json(http: httpx.Client, token: str, path: Path, **fields: Any) -> httpx.Response:
    return http.post(
        "/face-search", headers=auth(token), json={"type": "face_search", "file": data_uri(path), **fields}
    )


def face_search_multipart(http: httpx.Client, token: str, path: Path, **fields: Any) -> httpx.Response:
    files = {"file": (path.name, path.read_bytes(), "application/octet-stream")}
    data = {"type": "face_search", **{key: str(value) for key, value in fields.items()}}
    return http.post("/face-search", headers=auth(token), data=data, files=files)


def age_estimation(http: httpx.Client, token: str, path: Path, **fields: Any) -> httpx.Response:
    files = {"file": (path.name, path.read_bytes(), "application/octet-stream")}
    data = {"type": "age_estimation", **{key: str(value) for key, value in fields.items()}}
    return http.post("/age-estimation", headers=auth(token), data=data, files=files)


def reference_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] is True
    return str(body["result"]["data"]["reference_id"])


def wait_result(http: httpx.Client, token: str, reference_id: str, timeout_s: float = 120) -> dict[str, Any]:
    """Poll /result until it is final (200); 202 means not final yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = http.post("/result", headers=auth(token), json={"reference_id": reference_id})
        if response.status_code == 200:
            body: dict[str, Any] = response.json()
            return body
        assert response.status_code == 202, response.text
        assert response.json()["result"]["data"]["state"] in ("queued", "processing")
        time.sleep(0.2)
    raise TimeoutError(f"transaction {reference_id} not final after {timeout_s}s")

"""The requests of the facesearch API, built without sending them (shared by the sync and async clients),
and the one place that reads the service's envelope."""

from __future__ import annotations

import base64
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from facesearch_client.errors import ApiError, AuthenticationError, RetriesExhausted

# The service's largest gallery page (its OpenAPI document's `limit` maximum; the client stays installable
# without the server, and tests/unit/test_client_contract.py holds the two equal).
MAX_PAGE_SIZE = 200

Image = bytes | str | os.PathLike[str]


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: dict[str, Any] | None = None
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, bytes, str]] | None = None
    params: dict[str, str] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    authenticated: bool = True
    # Sending it twice acts once (a read, a login, a create carrying its Idempotency-Key): a call whose
    # connection broke before any answer came is sent again, since it may or may not have reached the
    # service (an ingress replica that died while receiving it, say).
    repeatable: bool = False


def _image(image: Image, filename: str | None) -> tuple[str, bytes]:
    if isinstance(image, bytes):
        # The service checks an upload's extension too: name bytes after their format.
        return filename or f"image.{'png' if _subtype(image) == 'png' else 'jpg'}", image
    path = Path(image)
    return filename or path.name, path.read_bytes()


def _subtype(content: bytes) -> str:
    return "png" if content.startswith(b"\x89PNG") else "jpeg"


def _flag(value: bool) -> str:
    return "1" if value else "0"


def prefer_wait(wait_s: float | None) -> dict[str, str]:
    """RFC 7240 `Prefer: wait=N` (whole seconds, at least 1), or no header for None or 0: the service holds
    the request until the transaction is final or N seconds (capped by the service) pass."""
    return {"Prefer": f"wait={max(1, round(wait_s))}"} if wait_s else {}


def _idempotency(key: str | None) -> dict[str, str]:
    """The Idempotency-Key of one logical create: the Call carries it, so every retry of the Call (on 503,
    429, after a fresh login) sends the same key and the service creates the transaction at most once.
    A caller that retries across runs (bulk enrolment) passes the key it recorded."""
    return {"Idempotency-Key": key or str(uuid.uuid4())}


def login(client_id: str, client_secret: str) -> Call:
    return Call(
        "POST",
        "/request-access-token",
        json={"client_id": client_id, "client_secret": client_secret},
        authenticated=False,
        repeatable=True,
    )


def face_search(
    image: Image,
    *,
    client_reference: str | None = None,
    allow_override: bool | None = None,
    enroll_face: bool | None = None,
    as_json: bool = False,
    filename: str | None = None,
    extra: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    wait_s: float | None = None,
) -> Call:
    """as_json: send the image as a Base64 data URI in a JSON body instead of a multipart upload.
    idempotency_key: this request's key (default: a new UUID, reused by every retry of the Call).
    wait_s: Prefer: wait=N, the result in the create's own answer when it is final within N seconds."""
    headers = {**_idempotency(idempotency_key), **prefer_wait(wait_s)}
    name, content = _image(image, filename)
    fields: dict[str, Any] = {"type": "face_search"}
    if client_reference is not None:
        fields["client_reference"] = client_reference
    if allow_override is not None:
        fields["allow_override"] = _flag(allow_override)
    if enroll_face is not None:
        fields["enroll_face"] = _flag(enroll_face)
    fields.update(extra or {})
    if as_json:
        uri = f"data:image/{_subtype(content)};base64,{base64.b64encode(content).decode()}"
        # extra comes last so a caller (a test of bad input) may replace any field, the file included.
        body = {"type": "face_search", "file": uri, **fields, **(extra or {})}
        return Call("POST", "/face-search", json=body, headers=headers, repeatable=True)
    data = {key: str(value) for key, value in fields.items()}
    return Call(
        "POST",
        "/face-search",
        data=data,
        files={"file": (name, content, "application/octet-stream")},
        headers=headers,
        repeatable=True,
    )


def age_estimation(
    image: Image,
    *,
    enroll_face: bool | None = None,
    wait_for_result: bool | None = None,
    filename: str | None = None,
    extra: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    wait_s: float | None = None,
) -> Call:
    name, content = _image(image, filename)
    data = {"type": "age_estimation"}
    if enroll_face is not None:
        data["enroll_face"] = _flag(enroll_face)
    if wait_for_result is not None:
        data["wait_for_result"] = _flag(wait_for_result)
    data.update({key: str(value) for key, value in (extra or {}).items()})
    return Call(
        "POST",
        "/age-estimation",
        data=data,
        files={"file": (name, content, "application/octet-stream")},
        headers={**_idempotency(idempotency_key), **prefer_wait(wait_s)},
        repeatable=True,
    )


def result(reference_id: str, wait_s: float | None = None) -> Call:
    """wait_s: long poll (Prefer: wait=N, RFC 7240): the service holds the request until the transaction
    is final or N seconds (capped by the service) pass."""
    return Call(
        "POST", "/result", json={"reference_id": reference_id}, headers=prefer_wait(wait_s), repeatable=True
    )


def list_faces(
    client_reference: str | None = None, limit: int | None = None, cursor: str | None = None
) -> Call:
    params = {
        key: str(value)
        for key, value in (("client_reference", client_reference), ("limit", limit), ("cursor", cursor))
        if value is not None
    }
    return Call("GET", "/gallery/faces", params=params, repeatable=True)


def delete_face(face_id: str) -> Call:
    return Call("DELETE", f"/gallery/faces/{face_id}")


def erase(client_reference: str) -> Call:
    return Call("POST", "/gallery/erasures", json={"client_reference": client_reference})


def gallery_stats() -> Call:
    return Call("GET", "/gallery/stats", repeatable=True)


def audit(limit: int | None = None, cursor: str | None = None) -> Call:
    params = {key: str(value) for key, value in (("limit", limit), ("cursor", cursor)) if value is not None}
    return Call("GET", "/gallery/audit", params=params, repeatable=True)


def error_of(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
        message, errors = str(body.get("message", "")), dict(body.get("errors") or {})
    except (ValueError, AttributeError):
        message, errors = response.text[:200], {}
    kind = {
        401: AuthenticationError,
        429: RetriesExhausted,
        503: RetriesExhausted,
        507: RetriesExhausted,
    }.get(response.status_code, ApiError)
    return kind(response.status_code, message or response.reason_phrase, errors)


def data_of(response: httpx.Response) -> dict[str, Any]:
    """result.data of a successful envelope (200 or 202); ApiError for anything else."""
    if response.status_code not in (200, 202):
        raise error_of(response)
    body = response.json()
    if body.get("status") is not True and response.status_code != 200:
        raise error_of(response)
    data: dict[str, Any] = (body.get("result") or {}).get("data") or {}
    return data

"""Reading request bodies into plain fields, and the interface's field rules."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request

from serve_app.api.limits import BodyTooLarge
from serve_app.domain.errors import PayloadTooLarge, UnsupportedMedia, ValidationFailed
from serve_app.imaging.decode import ACCEPTED_EXTENSIONS

logger = logging.getLogger(__name__)

_DATA_URI = re.compile(r"^data:image/(?P<subtype>[A-Za-z0-9.+-]+);base64,$")
_PREFER_WAIT = re.compile(r"^\s*wait\s*=\s*\"?(?P<seconds>\d{1,6})\"?\s*$", re.IGNORECASE)
_ACCEPTED_SUBTYPES = {"jpeg", "jpg", "png", "pjpeg"}
_TRUE = {"1", "true"}
_FALSE = {"0", "false"}


@dataclass(frozen=True)
class Body:
    fields: dict[str, Any]
    files: dict[str, UploadFile]
    is_json: bool


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def read_body(request: Request, accepted: tuple[str, ...], max_part_bytes: int) -> Body:
    kind = media_type(request)
    if kind not in accepted:
        raise UnsupportedMedia(
            f"Content-Type must be one of: {', '.join(accepted)}.", {"content-type": kind or "missing"}
        )
    if kind == "application/json":
        raw = await request.body()
        if not raw.strip():
            raise ValidationFailed("The request body is empty.", {"body": "empty"})
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integer literals;
            # RecursionError a hostile nesting depth.
            raise ValidationFailed("The request body is not valid JSON.", {"body": "invalid JSON"}) from None
        if not isinstance(parsed, dict):
            raise ValidationFailed("The JSON body must be an object.", {"body": "not an object"})
        for key, value in parsed.items():
            # JSON escapes can spell lone surrogates, which no store can encode: refuse them here.
            if not _is_utf8(key) or (isinstance(value, str) and not _is_utf8(value)):
                raise ValidationFailed("The request body is not valid JSON.", {"body": "invalid JSON"})
        return Body(fields=parsed, files={}, is_json=True)
    try:
        form = await request.form(max_files=2, max_fields=20, max_part_size=max_part_bytes)
    except BodyTooLarge:
        raise  # the body-size middleware answers 413
    except Exception as error:  # multipart parser errors carry no stable type across versions
        # The parser's own text names library internals: it goes to the log, not to the client.
        logger.info("unparseable form body: %s: %s", type(error).__name__, str(error)[:200])
        raise ValidationFailed(
            "The form body could not be parsed.", {"body": "malformed form data"}
        ) from None
    fields: dict[str, Any] = {}
    files: dict[str, UploadFile] = {}
    for key, value in form.multi_items():
        # A repeated field is ambiguous (which value counts?): refuse it rather than let the last one win.
        if key in fields or key in files:
            name = key[:100]
            raise ValidationFailed(
                f"The field '{name}' is given more than once.", {name: "given more than once"}
            )
        if isinstance(value, str):
            fields[key] = value
        else:
            files[key] = value
    return Body(fields=fields, files=files, is_json=False)


def require_type(body: Body, expected: str) -> None:
    value = body.fields.get("type")
    if value is None:
        raise ValidationFailed("The field 'type' is required.", {"type": "required"})
    if value != expected:
        raise ValidationFailed(f"The field 'type' must be '{expected}'.", {"type": f"must be '{expected}'"})


def parse_flag(body: Body, name: str, default: bool, allow_words: bool = True) -> bool:
    """1/0, and true/false where the interface allows them (JSON booleans, or the words in a form)."""
    value = body.fields.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        if allow_words:
            return value
    elif isinstance(value, int):
        if value in (0, 1):
            return bool(value)
    elif isinstance(value, str):
        lowered = value.strip().lower()
        accepted_true = _TRUE if allow_words else {"1"}
        accepted_false = _FALSE if allow_words else {"0"}
        if lowered in accepted_true:
            return True
        if lowered in accepted_false:
            return False
    allowed = "1, 0, true or false" if allow_words else "0 or 1"
    raise ValidationFailed(f"The field '{name}' must be {allowed}.", {name: f"must be {allowed}"})


def parse_client_reference(body: Body, required: bool) -> str | None:
    value = body.fields.get("client_reference")
    if value is None or value == "":
        if required:
            raise ValidationFailed(
                "client_reference is required when allow_override is 1.", {"client_reference": "required"}
            )
        return None
    if not isinstance(value, str):
        raise ValidationFailed("client_reference must be a string.", {"client_reference": "must be a string"})
    if not 5 <= len(value) <= 255:
        raise ValidationFailed(
            "client_reference must be 5 to 255 characters long.",
            {"client_reference": "length must be 5 to 255"},
        )
    if any(ord(char) < 32 for char in value):
        raise ValidationFailed(
            "client_reference must not contain control characters.",
            {"client_reference": "control characters"},
        )
    return value


def image_from_data_uri(body: Body) -> bytes:
    value = body.fields.get("file")
    if value is None or value == "":
        raise ValidationFailed("The field 'file' is required.", {"file": "required"})
    if not isinstance(value, str):
        raise ValidationFailed("'file' must be a data URI string.", {"file": "must be a string"})
    # The prefix is matched on the head alone: a regex over a multi-megabyte payload costs the ingress CPU.
    head, comma, payload = value.strip().partition(",")
    match = _DATA_URI.match(head + comma) if comma else None
    if match is None:
        raise ValidationFailed(
            "'file' must be a data URI with the prefix data:image/<subtype>;base64, "
            "(plain Base64 is rejected).",
            {"file": "missing data URI prefix"},
        )
    if match["subtype"].lower() not in _ACCEPTED_SUBTYPES:
        raise UnsupportedMedia(
            f"Images of type image/{match['subtype']} are not accepted; send JPEG or PNG.",
            {"file": "only image/jpeg and image/png"},
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        # Line-wrapped Base64 (MIME style) is still Base64: drop the whitespace and try once more.
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValidationFailed("'file' is not valid Base64.", {"file": "invalid Base64"}) from None


async def image_from_upload(body: Body, max_bytes: int) -> bytes:
    upload = body.files.get("file")
    if upload is None:
        if "file" in body.fields:
            raise ValidationFailed("'file' must be an uploaded file.", {"file": "must be a file part"})
        raise ValidationFailed("The field 'file' is required.", {"file": "required"})
    name = (upload.filename or "").lower()
    if not name.endswith(ACCEPTED_EXTENSIONS):
        raise UnsupportedMedia(
            "The uploaded file must be a .jpg, .jpeg or .png image.",
            {"file": "extension must be .jpg/.jpeg/.png"},
        )
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"The uploaded file exceeds the limit of {max_bytes} bytes.", {"file": "too large"}
        )
    return data


def _is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def preferred_wait_s(prefer_headers: list[str], cap_s: float) -> float:
    """Seconds a client asks /result to wait for the final state, from RFC 7240 `Prefer: wait=N`.

    The RFC has servers ignore preferences they do not understand, so a malformed or absent one means no
    wait rather than a 4xx; the wait is capped by the server's own bound.
    """
    for header in prefer_headers:
        for preference in header.split(","):
            token = preference.split(";", 1)[0]
            if match := _PREFER_WAIT.match(token):
                return min(float(match["seconds"]), cap_s)
    return 0.0

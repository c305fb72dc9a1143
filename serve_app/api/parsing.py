"""Reading request bodies into plain fields (the transport); the field rules are in request_models."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.requests import Request

from serve_app.api.limits import BodyTooLarge
from serve_app.api.request_models import Upload
from serve_app.domain.errors import UnsupportedMedia, ValidationFailed

logger = logging.getLogger(__name__)

JSON = "application/json"
MULTIPART = "multipart/form-data"
URLENCODED = "application/x-www-form-urlencoded"
_PREFER_WAIT = re.compile(r"^\s*wait\s*=\s*\"?(?P<seconds>\d{1,6})\"?\s*$", re.IGNORECASE)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def read_fields(request: Request, accepted: tuple[str, ...], max_part_bytes: int) -> dict[str, Any]:
    """The body's fields: JSON values as parsed, form fields as strings and file parts as Uploads (read up
    to max_part_bytes + 1, so the rule that refuses an oversized image can see that it is one)."""
    kind = media_type(request)
    if kind not in accepted:
        raise UnsupportedMedia(
            f"Content-Type must be one of: {', '.join(accepted)}.", {"content-type": kind or "missing"}
        )
    if kind == JSON:
        return await _json_fields(request)
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
    try:
        for key, value in form.multi_items():
            # A repeated field is ambiguous (which value counts?): refuse it rather than let the last win.
            if key in fields:
                name = key[:100]
                raise ValidationFailed(
                    f"The field '{name}' is given more than once.", {name: "given more than once"}
                )
            if isinstance(value, str):
                fields[key] = value
            else:
                data = await value.read(max_part_bytes + 1)
                fields[key] = Upload(filename=value.filename or "", data=data)
    finally:
        # The parts are read into memory above; close their spooled files now rather than at GC time.
        await form.close()
    return fields


async def _json_fields(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise ValidationFailed("The request body is empty.", {"body": "empty"})
    try:
        # orjson first (several times faster on the large base64 bodies of face search); it refuses some
        # documents the standard parser accepts (NaN, integers beyond 64 bits, escaped lone surrogates),
        # and those take the standard path, so what is accepted never depends on the parser.
        parsed = orjson.loads(raw)
        checked_utf8 = True  # orjson never yields a lone surrogate
    except orjson.JSONDecodeError:
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integer literals;
            # RecursionError a hostile nesting depth.
            raise ValidationFailed("The request body is not valid JSON.", {"body": "invalid JSON"}) from None
        checked_utf8 = False
    if not isinstance(parsed, dict):
        raise ValidationFailed("The JSON body must be an object.", {"body": "not an object"})
    if not checked_utf8:
        for key, value in parsed.items():
            # JSON escapes can spell lone surrogates, which no store can encode: refuse them here.
            if not _is_utf8(key) or (isinstance(value, str) and not _is_utf8(value)):
                raise ValidationFailed("The request body is not valid JSON.", {"body": "invalid JSON"})
    return parsed


def _is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def preferred_wait_s(prefer_headers: Sequence[str], cap_s: float) -> float:
    """Seconds a client asks /result, or a create, to wait for the final state, from RFC 7240
    `Prefer: wait=N`.

    The RFC has servers ignore preferences they do not understand, so a malformed or absent one means no
    wait rather than a 4xx; the wait is capped by the server's own bound.
    """
    for header in prefer_headers:
        for preference in header.split(","):
            token = preference.split(";", 1)[0]
            if match := _PREFER_WAIT.match(token):
                return min(float(match["seconds"]), cap_s)
    return 0.0

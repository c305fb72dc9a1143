"""Verifying the service's completion webhooks (Standard Webhooks signatures; docs/api.md, "Webhooks").

    from facesearch_client import WebhookVerificationError, verify_webhook

    try:
        event = verify_webhook(secret, request.headers, request.body)  # the raw body, not re-serialised
    except WebhookVerificationError:
        return 400
    if seen(event["id"]):  # delivery is at least once: deduplicate by the event id
        return 200

Pass several secrets (a list) while rotating: the service signs with the old and the new one for the
rotation's grace period, and either verifies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from facesearch_client.errors import FaceSearchError

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300


class WebhookVerificationError(FaceSearchError):
    """The request is not a genuine, fresh webhook of the service: reject it (answer 400)."""


def verify_webhook(
    secret: str | Sequence[str],
    headers: Mapping[str, str],
    body: bytes | str,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> dict[str, Any]:
    """The event (the parsed JSON body) once its signature and timestamp check out.

    secret: the `whsec_...` secret shown at registration or rotation, or several. headers: the request's
    headers, any case. body: the raw request body exactly as received. The timestamp must lie within
    tolerance_s of now (replay protection); any of the space-separated `v1,` signatures may match, each
    compared in constant time."""
    lowered = {name.lower(): value for name, value in headers.items()}
    message_id = lowered.get("webhook-id")
    timestamp = lowered.get("webhook-timestamp")
    signatures = lowered.get("webhook-signature")
    if not message_id or not timestamp or not signatures:
        raise WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature")
    try:
        sent_at = int(timestamp)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not an integer") from None
    current = time.time() if now is None else now
    if abs(current - sent_at) > tolerance_s:
        raise WebhookVerificationError("webhook-timestamp is outside the tolerance")
    raw = body.encode() if isinstance(body, str) else bytes(body)
    signed = f"{message_id}.{sent_at}.".encode() + raw
    expected = [
        base64.b64encode(hmac.new(_key(one), signed, hashlib.sha256).digest())
        for one in ([secret] if isinstance(secret, str) else list(secret))
    ]
    for candidate in signatures.split(" "):
        version, _, value = candidate.partition(",")
        if version != "v1":
            continue
        if any(hmac.compare_digest(value.encode(), digest) for digest in expected):
            try:
                event: dict[str, Any] = json.loads(raw)
            except ValueError:
                raise WebhookVerificationError("the body is not JSON") from None
            return event
    raise WebhookVerificationError("no signature matches")


def _key(secret: str) -> bytes:
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise WebhookVerificationError("the secret is not a whsec_ base64 secret") from None

"""Idempotent creates (the IETF httpapi Idempotency-Key draft): a client names each logical request with a
key and sends that key again on every retry. The first request with a key creates the transaction and
records (key -> fingerprint, reference_id); a later one with the same key and the same request is answered
with that reference_id and creates nothing, and one with the same key and another request is refused
(IdempotencyConflict, 422). Both the check and the record happen inside the store's create, atomically, so
two concurrent requests with one key create one transaction."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from serve_app.domain.errors import ValidationFailed

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
# The draft's value is a Structured Field string ("..."); a bare token is taken as the same key. Visible
# ASCII only: the key goes into logs and is hashed into a store key, never echoed elsewhere.
_KEY = re.compile(r'^"?(?P<key>[\x20\x21\x23-\x5b\x5d-\x7e]{1,255})"?$')


class IdempotencyConflict(ValidationFailed):
    """The key was used before for a different request (the draft's 422)."""


@dataclass(frozen=True)
class IdempotencyClaim:
    """What a keyed create asks the store to check and record: the key (scoped to the tenant) and the
    fingerprint of the request it names."""

    tenant_id: str
    key: str
    fingerprint: str

    @property
    def digest(self) -> str:
        """The store's name for the key: fixed length whatever the client sent, and never the key itself."""
        return hashlib.sha256(f"{self.tenant_id}\0{self.key}".encode()).hexdigest()


def parse_key(header: str | None) -> str | None:
    """The key of an Idempotency-Key header (None when absent); ValidationFailed when malformed."""
    if header is None:
        return None
    match = _KEY.match(header.strip())
    if match is None:
        raise ValidationFailed(
            f"The {HEADER} header must be 1 to {MAX_KEY_LENGTH} visible ASCII characters.",
            {HEADER: "invalid"},
        )
    return match["key"]


def fingerprint(tenant_id: str, kind: str, fields: Mapping[str, object], image: bytes) -> str:
    """What makes two requests the same: the tenant, the transaction type, the parsed fields (as the
    service reads them, so "1" and "true" are one value) and the image bytes (their SHA-256)."""
    digest = hashlib.sha256()
    for part in (tenant_id, kind, *(f"{name}={fields[name]!r}" for name in sorted(fields))):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(hashlib.sha256(image).digest())
    return digest.hexdigest()

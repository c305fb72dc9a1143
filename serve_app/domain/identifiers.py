"""The identifiers the service issues, and their formats.

The API refuses any other value with a 422 before it reaches a store, and the stores put into Redis key
names only values of these formats or hashes, so no request can name an internal key.
"""

from __future__ import annotations

import re
import secrets
import uuid

_REFERENCE_ID = re.compile(r"[0-9a-f]{32}")
_CLIENT_ID = re.compile(r"cl_[0-9a-f]{24}")
# An enrolled face is named after the transaction that enrolled it: "f" + its reference_id (the rule:
# enrolled_face_id and reference_id_of_face, written here once).
_FACE_ID_PREFIX = "f"
_FACE_ID = re.compile(f"{_FACE_ID_PREFIX}{_REFERENCE_ID.pattern}")
# A proof token is a compact JWS (three base64url parts); the length bound keeps a hostile URL cheap.
_PROOF_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,1024}\.[A-Za-z0-9_-]{1,1024}\.[A-Za-z0-9_-]{1,256}")

REFERENCE_ID_PATTERN = f"^{_REFERENCE_ID.pattern}$"
CLIENT_ID_PATTERN = f"^{_CLIENT_ID.pattern}$"
FACE_ID_PATTERN = f"^{_FACE_ID.pattern}$"


def new_reference_id() -> str:
    return uuid.uuid4().hex


def new_client_id() -> str:
    return f"cl_{secrets.token_hex(12)}"


def new_client_secret() -> str:
    """A URL-safe secret (256 bits) that never starts with "-", which a command line reads as an option."""
    while True:
        secret = secrets.token_urlsafe(32)
        if not secret.startswith("-"):
            return secret


def is_reference_id(value: object) -> bool:
    return isinstance(value, str) and _REFERENCE_ID.fullmatch(value) is not None


def is_client_id(value: object) -> bool:
    return isinstance(value, str) and _CLIENT_ID.fullmatch(value) is not None


def is_face_id(value: object) -> bool:
    return isinstance(value, str) and _FACE_ID.fullmatch(value) is not None


def enrolled_face_id(reference_id: str) -> str:
    """The face a transaction enrols: retried attempts of it write the same face."""
    return f"{_FACE_ID_PREFIX}{reference_id}"


def reference_id_of_face(face_id: str) -> str | None:
    """The reference id of the transaction that enrolled the face; None for a value that is no face id."""
    return face_id.removeprefix(_FACE_ID_PREFIX) if is_face_id(face_id) else None


def is_proof_token(value: object) -> bool:
    return isinstance(value, str) and _PROOF_TOKEN.fullmatch(value) is not None

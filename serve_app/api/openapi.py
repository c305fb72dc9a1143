"""OpenAPI documentation of the bodies the handlers parse themselves (JSON and multipart side by side), the
response shapes, and the decisions taken where the interface says "not shown"."""

from __future__ import annotations

from typing import Any

from serve_app.domain.identifiers import CLIENT_ID_PATTERN, REFERENCE_ID_PATTERN

# The field rules below state exactly what serve_app.api.parsing accepts. Flag strings are compared after
# str.strip() and lower(), and an empty string (or a JSON null) counts as absent; str.strip() also removes
# \x1c-\x1f and \x85, which \s need not match.
_STRIPPED = "[\\s\\x1c-\\x1f\\x85]*"


def _flag_string(words: str) -> dict[str, Any]:
    return {"type": "string", "pattern": f"^({_STRIPPED}({words}){_STRIPPED})?$"}


_BOOL_01 = {
    "oneOf": [
        {"type": "boolean"},
        {"type": "integer", "enum": [0, 1]},
        _flag_string("[01]|[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]"),
    ]
}
_JSON_BOOL_01 = {"oneOf": [*_BOOL_01["oneOf"], {"type": "null"}]}
_CLIENT_REFERENCE = {
    "type": "string",
    "maxLength": 255,
    "pattern": "^([^\\x00-\\x1f]{5,})?$",
    "description": "5 to 255 characters, no control characters; empty means absent",
}


# The handlers refuse an empty client_id, client_secret or reference_id with 422 ("required"), and an
# identifier that is not of the form the service issues with 422 too (serve_app/domain/identifiers.py).
_NON_EMPTY = {"type": "string", "minLength": 1}
_CLIENT_ID = {
    "type": "string",
    "pattern": CLIENT_ID_PATTERN,
    "description": "as issued: cl_ and 24 lowercase hex digits",
}
_REFERENCE_ID = {
    "type": "string",
    "pattern": REFERENCE_ID_PATTERN,
    "description": "as returned by a create call: 32 lowercase hex digits",
}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


def _envelope(data: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {
            "status": {"type": "boolean", "const": True},
            "message": {"type": "string"},
            "result": _object({"data": data}, ["data"]),
        },
        ["status", "message", "result"],
    )


ERROR_ENVELOPE = _object(
    {
        "status": {"type": "boolean", "const": False},
        "message": {"type": "string"},
        "errors": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    ["status", "message", "errors"],
)

# A transaction that ended in `failed`: HTTP 200 from /result (and from /age-estimation with
# wait_for_result=1) with the error envelope, plus the reference_id and state.
_FAILED_TRANSACTION = _object(
    {
        "status": {"type": "boolean", "const": False},
        "message": {"type": "string"},
        "errors": {"type": "object", "additionalProperties": {"type": "string"}},
        "result": _object(
            {
                "data": _object(
                    {"reference_id": {"type": "string"}, "state": {"type": "string", "enum": ["failed"]}},
                    ["reference_id", "state"],
                )
            },
            ["data"],
        ),
    },
    ["status", "message", "errors", "result"],
)

_FACE_SEARCH_FIELDS = {
    "type": {"type": "string", "enum": ["face_search"]},
    "client_reference": _CLIENT_REFERENCE,
    "allow_override": _BOOL_01,
    "enroll_face": _BOOL_01,
}
_FACE_SEARCH_JSON_FIELDS = {
    **_FACE_SEARCH_FIELDS,
    "client_reference": {**_CLIENT_REFERENCE, "type": ["string", "null"]},
    "allow_override": _JSON_BOOL_01,
    "enroll_face": _JSON_BOOL_01,
}

REQUEST_BODIES: dict[str, dict[str, Any]] = {
    "token": {
        "requestBody": {
            "required": True,
            "content": {
                media: {
                    "schema": _object(
                        {"client_id": _CLIENT_ID, "client_secret": _NON_EMPTY},
                        ["client_id", "client_secret"],
                    )
                }
                for media in ("application/json", "application/x-www-form-urlencoded")
            },
        }
    },
    "face_search": {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": _object(
                        {
                            **_FACE_SEARCH_JSON_FIELDS,
                            "file": {
                                "type": "string",
                                "pattern": "^data:image/(jpeg|jpg|png);base64,",
                                "description": "Base64 data URI",
                            },
                        },
                        ["type", "file"],
                    )
                },
                "multipart/form-data": {
                    "schema": _object(
                        {
                            **_FACE_SEARCH_FIELDS,
                            "file": {
                                "type": "string",
                                "format": "binary",
                                "description": ".jpg, .jpeg or .png",
                            },
                        },
                        ["type", "file"],
                    )
                },
            },
        }
    },
    "age": {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": _object(
                        {
                            "type": {"type": "string", "enum": ["age_estimation"]},
                            "file": {
                                "type": "string",
                                "format": "binary",
                                "description": ".jpg, .jpeg or .png",
                            },
                            "enroll_face": _BOOL_01,
                            "wait_for_result": _flag_string("[01]"),
                        },
                        ["type", "file"],
                    )
                }
            },
        }
    },
    "result": {
        "parameters": [
            {
                "name": "Prefer",
                "in": "header",
                "required": False,
                "description": (
                    "RFC 7240 `wait=<seconds>`: hold the request until the transaction is final or the "
                    "wait (capped by the server's wait_for_result bound, 10 s by default) runs out, "
                    "instead of answering 202 at once. Answers carry `Preference-Applied` when honoured."
                ),
                "schema": {"type": "string", "pattern": "^wait=[0-9]{1,2}$", "example": "wait=5"},
            }
        ],
        "requestBody": {
            "required": True,
            "content": {
                media: {"schema": _object({"reference_id": _REFERENCE_ID}, ["reference_id"])}
                for media in ("application/json", "application/x-www-form-urlencoded")
            },
        },
    },
}

_ERRORS: dict[int | str, dict[str, Any]] = {
    "401": {
        "description": "Missing, invalid, expired or revoked credentials",
        "content": {"application/json": {"schema": ERROR_ENVELOPE}},
    },
    "413": {
        "description": "Body or image over the size / pixel limit",
        "content": {"application/json": {"schema": ERROR_ENVELOPE}},
    },
    "415": {
        "description": "Wrong Content-Type or not a JPEG/PNG image",
        "content": {"application/json": {"schema": ERROR_ENVELOPE}},
    },
    "422": {
        "description": "A field is missing or breaks its rule",
        "content": {"application/json": {"schema": ERROR_ENVELOPE}},
    },
    "429": {
        "description": "Rate limited; see Retry-After",
        "content": {"application/json": {"schema": ERROR_ENVELOPE}},
    },
    "503": {
        "description": "Redis, Milvus or a model is unavailable; retry later. The message is fixed: what "
        "the backend said goes to the service log only",
        "content": {"application/json": {"schema": ERROR_ENVELOPE}},
    },
}

_QUALITY = _object(
    {
        "reasons": {
            "type": "array",
            "items": {
                "type": "string",
                "enum": ["small_face", "low_detector_score", "blurry", "extreme_pose", "below_search_bar"],
            },
        },
        "face_size_px": {"type": "number", "description": "shorter side of the face box"},
        "detector_score": {"type": "number"},
        "sharpness": {
            "type": "number",
            "description": "variance of the Laplacian of the aligned 112 px chip",
        },
        "yaw": {"type": "number", "description": "0 frontal, about +-1 with the nose in an eye's column"},
        "pitch": {"type": "number", "description": "nose between eye line (0) and mouth line (1)"},
        "roll_deg": {"type": "number"},
    },
    ["reasons"],
)
# Extension (like AWS IndexFaces' UnindexedFaces): present only when enrolment was asked for and the face
# missed the quality gate's enrolment bar; the face was searched (face search) but not stored.
_UNINDEXED_FACES = {
    "type": "array",
    "description": "Extension: the face was not enrolled because it misses the enrolment quality bar",
    "items": _QUALITY,
}
_AGE_DATA = _object(
    {
        "reference_id": {"type": "string"},
        "age": {"type": ["integer", "null"]},
        "under_18": {"type": ["integer", "null"], "enum": [0, 50, 100, None]},
        "under_21": {"type": ["integer", "null"], "enum": [0, 50, 100, None]},
        "unindexed_faces": _UNINDEXED_FACES,
    },
    ["reference_id", "age", "under_18", "under_21"],
)
_FACE_DATA = _object(
    {
        "service_reference_id": {"type": "string"},
        "client_reference": {"type": "string"},
        "face_search_response": _object(
            {
                "result": _object(
                    {
                        "matched_faces": {
                            "type": "array",
                            "description": "[proof_id, score 0..1, proof URL (15 min), client_reference], "
                            "best first; [] when none. score = -log10(FMR)/10: the per-comparison "
                            "false-match rate calibrated on labelled photos (0.3: 1e-3, 0.5: 1e-5, "
                            "0.8: 1e-8). By default only matches that keep the false-positive "
                            "identification rate <= 1% for the tenant's gallery size are listed",
                            "items": {
                                "type": "array",
                                "prefixItems": [
                                    {"type": "string"},
                                    {"type": "number"},
                                    {"type": "string"},
                                    {"type": "string"},
                                ],
                            },
                        },
                        "is_face_found": {"type": "boolean"},
                        "unindexed_faces": _UNINDEXED_FACES,
                        "probe_quality": {
                            **_object({**_QUALITY["properties"], "search_ok": {"const": False}}, ["reasons"]),
                            "description": "Extension, present only when the probe misses the search "
                            "quality bar: it was searched against a ten times stricter false-positive "
                            "rate and its scores are capped at 0.5",
                        },
                    },
                    ["matched_faces", "is_face_found"],
                )
            },
            ["result"],
        ),
    },
    ["service_reference_id", "client_reference", "face_search_response"],
)
_RETRY_AFTER = {"description": "Seconds before polling again", "schema": {"type": "integer"}}
_RETRY_LATER = {"description": "Seconds before trying again", "schema": {"type": "integer"}}
_PREFERENCE_APPLIED = {
    "description": "`wait=<seconds>` when the request's `Prefer: wait` was honoured (long polling)",
    "schema": {"type": "string"},
}
_PENDING = {
    "description": "Not final yet: poll /result again after Retry-After seconds",
    "headers": {"Retry-After": _RETRY_AFTER},
    "content": {
        "application/json": {
            "schema": _envelope(
                _object(
                    {
                        "reference_id": {"type": "string"},
                        "state": {"type": "string", "enum": ["queued", "processing"]},
                    },
                    ["reference_id", "state"],
                )
            )
        }
    },
}

RESPONSES: dict[str, dict[int | str, dict[str, Any]]] = {
    "token": {
        200: {
            "description": "Access token",
            "content": {
                "application/json": {
                    "schema": _envelope(
                        _object(
                            {
                                "token": {"type": "string"},
                                "token_type": {"type": "string"},
                                "expires_in": {"type": "integer"},
                            },
                            ["token", "expires_in"],
                        )
                    )
                }
            },
        },
        **{code: _ERRORS[code] for code in ("415", "422", "401", "503")},
        "429": {
            "description": "Too many failed logins for this client_id from this address (each attempt past "
            "the allowance waits twice as long as the one before), or too many unauthenticated requests "
            "from this address; see Retry-After",
            "headers": {"Retry-After": _RETRY_LATER},
            "content": {"application/json": {"schema": ERROR_ENVELOPE}},
        },
    },
    "create": {
        200: {
            "description": "Transaction created",
            "content": {
                "application/json": {
                    "schema": _envelope(_object({"reference_id": {"type": "string"}}, ["reference_id"]))
                }
            },
        },
        **_ERRORS,
    },
    "age_create": {
        200: {
            "description": "Transaction created (data: reference_id); with wait_for_result=1 and a final "
            "result, the data also carries the age result, or the body is the failed-transaction envelope",
            "content": {
                "application/json": {
                    "schema": {
                        "oneOf": [
                            _envelope(
                                {
                                    "anyOf": [
                                        _object({"reference_id": {"type": "string"}}, ["reference_id"]),
                                        _AGE_DATA,
                                    ]
                                }
                            ),
                            _FAILED_TRANSACTION,
                        ]
                    }
                }
            },
        },
        202: _PENDING,
        **_ERRORS,
    },
    "result": {
        200: {
            "description": "Final result (face search or age estimation data), or the failed-transaction "
            "envelope (status false, errors.transaction, result.data.state = failed)",
            "headers": {"Preference-Applied": _PREFERENCE_APPLIED},
            "content": {
                "application/json": {
                    "schema": {"oneOf": [_envelope({"oneOf": [_FACE_DATA, _AGE_DATA]}), _FAILED_TRANSACTION]}
                }
            },
        },
        202: {
            **_PENDING,
            "headers": {"Retry-After": _RETRY_AFTER, "Preference-Applied": _PREFERENCE_APPLIED},
        },
        **{code: _ERRORS[code] for code in ("401", "415", "422", "429", "503")},
    },
    "proof": {
        200: {"description": "The enrolled image", "content": {"image/jpeg": {}, "image/png": {}}},
        404: {
            "description": "Invalid or tampered token, or the face was replaced",
            "content": {"application/json": {"schema": ERROR_ENVELOPE}},
        },
        410: {
            "description": "The proof URL expired (15 minutes after issue)",
            "content": {"application/json": {"schema": ERROR_ENVELOPE}},
        },
        429: {
            "description": "Too many invalid proof URLs, failed logins or failed credentials from this "
            "address; see Retry-After",
            "headers": {"Retry-After": _RETRY_LATER},
            "content": {"application/json": {"schema": ERROR_ENVELOPE}},
        },
    },
}


def describe() -> str:
    return (
        "Face search (1:N) and age estimation. Create calls return a reference_id; POST /result returns the "
        "outcome. Authenticate with `Authorization: Bearer <token>` from /request-access-token, or with the "
        "`Client-Secret: <client secret>` header. Every error uses the envelope "
        '{"status": false, "message": ..., "errors": {...}}. A result that is not final yet answers 202 with '
        "`state` and a Retry-After header; send `Prefer: wait=<seconds>` to /result to have it wait for the "
        "final state instead (long polling). The probe of a transaction is the largest face in the image."
    )

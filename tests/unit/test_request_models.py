"""The interface's field rules, written once in serve_app.api.request_models: each rule on its own, and a
JSON body and a multipart form validating into the same model."""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any

import httpx
import jsonschema
import pytest
from fastapi import APIRouter, Query

from serve_app.api.app import create_app
from serve_app.api.dependencies import Tenant
from serve_app.api.request_models import (
    AccessTokenRequest,
    AgeEstimationRequest,
    FaceSearchForm,
    FaceSearchJson,
    FaceSearchRequest,
    ResultRequest,
    Upload,
    validate_body,
)
from serve_app.domain.errors import PayloadTooLarge, ServiceError, UnsupportedMedia, ValidationFailed
from tests.unit.fakes import build_api

IMAGE = b"\x89PNG\r\n\x1a\nnot really a png, the rules do not decode"
DATA_URI = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
LIMIT = 1024
CLIENT_ID = "cl_" + "a" * 24
REFERENCE_ID = "0" * 32


def upload(name: str = "face.png", data: bytes = IMAGE) -> Upload:
    return Upload(filename=name, data=data)


def search_json(**fields: Any) -> FaceSearchRequest:
    return validate_body(FaceSearchJson, {"type": "face_search", "file": DATA_URI, **fields}, LIMIT)


def search_form(**fields: Any) -> FaceSearchRequest:
    return validate_body(FaceSearchForm, {"type": "face_search", "file": upload(), **fields}, LIMIT)


def refused(model: Any, fields: dict[str, Any]) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        validate_body(model, fields, LIMIT)
    return caught.value


def test_json_and_multipart_validate_into_the_same_model() -> None:
    fields = {"client_reference": "customer-1", "allow_override": "1", "enroll_face": "0"}
    from_json = search_json(**fields)
    from_form = search_form(**fields)
    assert isinstance(from_json, FaceSearchRequest) and isinstance(from_form, FaceSearchRequest)
    assert (
        from_json.model_dump()
        == from_form.model_dump()
        == {
            "type": "face_search",
            "allow_override": True,
            "file": IMAGE,
            "client_reference": "customer-1",
            "enroll_face": False,
        }
    )


def test_defaults_apply_when_a_field_is_absent_null_or_empty() -> None:
    for absent in (
        {},
        {"allow_override": None, "enroll_face": None, "client_reference": None},
        {
            "allow_override": "",
            "enroll_face": "",
            "client_reference": "",
        },
    ):
        body = search_json(**absent)
        assert (body.allow_override, body.enroll_face, body.client_reference) == (False, True, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        ("1", True),
        ("0", False),
        (" TRUE ", True),
        ("False", False),
        ("\x1ctrue\x85", True),
    ],
)
def test_flags_accept_1_0_and_the_words(value: object, expected: bool) -> None:
    assert search_json(enroll_face=value).enroll_face is expected


@pytest.mark.parametrize("value", [2, -1, 1.0, "yes", "on", "tru", [], {}, "1 1"])
def test_flags_refuse_anything_else(value: object) -> None:
    error = refused(FaceSearchJson, {"type": "face_search", "file": DATA_URI, "enroll_face": value})
    assert isinstance(error, ValidationFailed)
    assert error.details == {"enroll_face": "must be 1, 0, true or false"}


def test_wait_for_result_takes_0_and_1_only() -> None:
    base = {"type": "age_estimation", "file": upload()}
    assert validate_body(AgeEstimationRequest, {**base, "wait_for_result": " 1"}, LIMIT).wait_for_result
    assert not validate_body(AgeEstimationRequest, {**base, "wait_for_result": "0"}, LIMIT).wait_for_result
    for word in ("true", "false", True, "2"):
        error = refused(AgeEstimationRequest, {**base, "wait_for_result": word})
        assert error.details == {"wait_for_result": "must be 0 or 1"}


def test_type_is_required_and_must_name_the_endpoint() -> None:
    assert refused(FaceSearchJson, {"file": DATA_URI}).details == {"type": "required"}
    assert refused(FaceSearchJson, {"type": None, "file": DATA_URI}).details == {"type": "required"}
    for wrong in ("age_estimation", "", "FACE_SEARCH", 1):
        error = refused(FaceSearchJson, {"type": wrong, "file": DATA_URI})
        assert isinstance(error, ValidationFailed) and error.details == {"type": "must be 'face_search'"}
    error = refused(AgeEstimationRequest, {"type": "face_search", "file": upload()})
    assert error.details == {"type": "must be 'age_estimation'"}


@pytest.mark.parametrize("length", [5, 255])
def test_client_reference_of_5_to_255_characters_is_kept_verbatim(length: int) -> None:
    reference = ("\U0001f600é " * 100)[:length]
    assert search_form(client_reference=reference).client_reference == reference


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("abcd", "length must be 5 to 255"),
        ("x" * 256, "length must be 5 to 255"),
        ("abc\x00de", "control characters"),
        ("abc\nde", "control characters"),
        (12345, "must be a string"),
    ],
)
def test_client_reference_rules(value: object, problem: str) -> None:
    error = refused(FaceSearchJson, {"type": "face_search", "file": DATA_URI, "client_reference": value})
    assert isinstance(error, ValidationFailed) and error.details == {"client_reference": problem}


def test_allow_override_needs_a_reference() -> None:
    for fields in ({"allow_override": 1}, {"allow_override": "true", "client_reference": ""}):
        error = refused(FaceSearchJson, {"type": "face_search", "file": DATA_URI, **fields})
        assert error.details == {"client_reference": "required"}
    assert search_json(allow_override=1, client_reference="abcde").allow_override


def test_data_uri_rules() -> None:
    payload = base64.b64encode(IMAGE).decode()
    for subtype in ("jpeg", "jpg", "png", "pjpeg", "PNG"):
        assert search_json(file=f"data:image/{subtype};base64,{payload}").file == IMAGE
    wrapped = "\n".join(payload[i : i + 8] for i in range(0, len(payload), 8))
    assert search_json(file=f"data:image/png;base64,{wrapped}").file == IMAGE
    cases: list[tuple[object, type[ServiceError], str]] = [
        (payload, ValidationFailed, "missing data URI prefix"),
        ("data:;base64," + payload, ValidationFailed, "missing data URI prefix"),
        ("data:image/gif;base64," + payload, UnsupportedMedia, "only image/jpeg and image/png"),
        ("data:image/png;base64," + payload[:-2] + "*", ValidationFailed, "invalid Base64"),
        (123, ValidationFailed, "must be a string"),
        (None, ValidationFailed, "required"),
        ("", ValidationFailed, "required"),
    ]
    for value, kind, problem in cases:
        error = refused(FaceSearchJson, {"type": "face_search", "file": value})
        assert type(error) is kind and error.details == {"file": problem}, (value, error)


def test_upload_rules() -> None:
    for name in ("a.jpg", "a.JPEG", "a.png"):
        assert search_form(file=upload(name)).file == IMAGE
    cases: list[tuple[object, type[ServiceError], str]] = [
        (upload("a.gif"), UnsupportedMedia, "extension must be .jpg/.jpeg/.png"),
        (upload(""), UnsupportedMedia, "extension must be .jpg/.jpeg/.png"),
        (upload(data=b"x" * (LIMIT + 1)), PayloadTooLarge, "too large"),
        ("a form field, not a file", ValidationFailed, "must be a file part"),
    ]
    for value, kind, problem in cases:
        error = refused(FaceSearchForm, {"type": "face_search", "file": value})
        assert type(error) is kind and error.details == {"file": problem}, (value, error)
    assert search_form(file=upload(data=b"x" * LIMIT)).file == b"x" * LIMIT


def test_the_first_broken_rule_in_field_order_is_reported() -> None:
    error = refused(FaceSearchJson, {"type": "age_estimation", "file": "data:image/gif;base64,AAAA"})
    assert isinstance(error, ValidationFailed) and error.details == {"type": "must be 'face_search'"}
    error = refused(FaceSearchJson, {"type": "face_search", "enroll_face": 7})
    assert error.details == {"file": "required"}


def test_access_token_request_rules() -> None:
    body = validate_body(AccessTokenRequest, {"client_id": CLIENT_ID, "client_secret": "s"})
    assert (body.client_id, body.client_secret) == (CLIENT_ID, "s")
    assert refused(AccessTokenRequest, {}).details == {"client_secret": "required", "client_id": "required"}
    assert refused(AccessTokenRequest, {"client_id": CLIENT_ID, "client_secret": ""}).details == {
        "client_secret": "required"
    }
    for wrong in ("cl_x", "CL_" + "a" * 24, CLIENT_ID + "0", 17):
        error = refused(AccessTokenRequest, {"client_id": wrong, "client_secret": "s"})
        assert error.details == {"client_id": "must be cl_ followed by 24 hex digits"}


def test_result_request_rules() -> None:
    assert validate_body(ResultRequest, {"reference_id": REFERENCE_ID}).reference_id == REFERENCE_ID
    assert refused(ResultRequest, {"reference_id": ""}).details == {"reference_id": "required"}
    for wrong in ("0" * 31, "A" * 32, 5, ["0" * 32]):
        error = refused(ResultRequest, {"reference_id": wrong})
        assert error.details == {"reference_id": "must be 32 lowercase hex digits"}


def test_unknown_fields_are_ignored() -> None:
    assert search_json(extra_field="anything").file == IMAGE


# 1.0 is left out: JSON Schema counts it as an integer, the rule (like the interface) does not.
FLAG_SAMPLES: tuple[object, ...] = (
    True,
    0,
    1,
    "1",
    " TRUE ",
    "\x1ctrue\x85",
    "False",
    2,
    "yes",
    "1 1",
    [],
    {},
)
REFERENCE_SAMPLES: tuple[object, ...] = ("abcde", "\U0001f600é" * 3, "abcd", "x" * 256, "abc\nde", 12345)
SCHEMA_SAMPLES = [("enroll_face", value) for value in FLAG_SAMPLES] + [
    ("client_reference", value) for value in REFERENCE_SAMPLES
]


@pytest.mark.parametrize(("name", "value"), SCHEMA_SAMPLES)
def test_the_json_schema_is_generated_from_the_rule_that_is_checked(name: str, value: object) -> None:
    """What the published schema of a field accepts is what its rule accepts (the schema is not written by
    hand beside the rule, so they cannot drift apart)."""
    schema = FaceSearchJson.model_json_schema()["properties"][name]
    schema_accepts = jsonschema.Draft202012Validator(schema).is_valid(value)
    try:
        search_json(**{name: value})
        rule_accepts = True
    except ValidationFailed:
        rule_accepts = False
    assert schema_accepts == rule_accepts


def test_identifier_and_image_schemas_come_from_the_rules() -> None:
    json_schema = FaceSearchJson.model_json_schema()
    form_schema = FaceSearchForm.model_json_schema()
    assert json_schema["required"] == form_schema["required"] == ["type", "file"]
    assert form_schema["properties"]["file"]["format"] == "binary"
    data_uri = jsonschema.Draft202012Validator(json_schema["properties"]["file"])
    assert data_uri.is_valid(DATA_URI) and not data_uri.is_valid(base64.b64encode(IMAGE).decode())
    reference_id = ResultRequest.model_json_schema()["properties"]["reference_id"]
    assert jsonschema.Draft202012Validator(reference_id).is_valid(REFERENCE_ID)
    assert not jsonschema.Draft202012Validator(reference_id).is_valid("0" * 31)


def test_a_router_added_later_gets_the_same_auth_and_never_fastapis_default_422() -> None:
    """What a further router module (e.g. gallery management) gets from create_app: the Tenant dependency,
    and FastAPI's own parameter validation answered in the common envelope."""

    async def scenario() -> None:
        api = await build_api()
        app = create_app(api.services)
        extra = APIRouter(tags=["extension"])

        @extra.get("/probe")
        async def probe(tenant: Tenant, limit: Annotated[int, Query(ge=1, le=200)] = 50) -> dict[str, Any]:
            return {"tenant": tenant, "limit": limit}

        app.include_router(extra)
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            ok = await http.get("/probe", params={"limit": 3}, headers=api.headers())
            assert ok.status_code == 200 and ok.json()["limit"] == 3
            assert ok.json()["tenant"] == api.client_id
            by_secret = await http.get("/probe", headers={"Client-Secret": api.client_secret})
            assert by_secret.status_code == 200 and by_secret.json()["tenant"] == api.client_id
            anonymous = await http.get("/probe")
            assert anonymous.status_code == 401 and anonymous.json()["status"] is False
            for bad in ("0", "x", "201"):
                refused = await http.get("/probe", params={"limit": bad}, headers=api.headers())
                assert refused.status_code == 422, refused.text
                assert refused.json() == {
                    "status": False,
                    "message": "The field 'limit' is invalid.",
                    "errors": {"limit": "invalid"},
                }

    asyncio.run(scenario())

"""The request bodies of the interface as pydantic models: each field rule is written once, here, next to
the JSON Schema that documents it, and FastAPI publishes these schemas in /openapi.json.

A JSON body and a multipart form validate into the same model: the form's parts arrive as strings and
`Upload`s, the JSON body's values as JSON types, and the subclasses for each media type differ only in how
the image arrives (a data URI or an uploaded file). A rule that fails raises the error `broken()` makes,
which carries the client-facing message, the field's problem and the status family; `validate_body` turns
the first one into the domain error that serve_app/api/errors.py maps to HTTP."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from serve_app.domain.errors import PayloadTooLarge, ServiceError, UnsupportedMedia, ValidationFailed
from serve_app.domain.identifiers import (
    CLIENT_ID_PATTERN,
    REFERENCE_ID_PATTERN,
    is_client_id,
    is_reference_id,
)
from serve_app.imaging.decode import ACCEPTED_EXTENSIONS

# Context key under which the route passes the upload limit to validation.
MAX_UPLOAD_BYTES = "max_upload_bytes"

_ERROR_KINDS: dict[str, Callable[[str, dict[str, str]], ServiceError]] = {
    "invalid": ValidationFailed,
    "unsupported": UnsupportedMedia,
    "too_large": PayloadTooLarge,
}


def broken(message: str, field: str, problem: str, kind: str = "invalid") -> PydanticCustomError:
    """A rule failure; pydantic collects it like its own errors, so field order decides which one wins."""
    return PydanticCustomError(
        "interface_rule", "{message}", {"message": message, "field": field, "problem": problem, "kind": kind}
    )


def as_service_error(error: ValidationError, missing_together: bool = False) -> ServiceError:
    """The first broken rule (in field order) as the domain error that the one error mapping turns into
    HTTP. With missing_together, every absent required field is named when the first problem is one."""
    problems = error.errors(include_url=False)
    first = problems[0]
    if first["type"] == "missing":
        names = [str(problem["loc"][-1]) for problem in problems if problem["type"] == "missing"]
        names = names if missing_together else names[:1]
        quoted = " and ".join(f"'{name}'" for name in names)
        verb = "is" if len(names) == 1 else "are"
        noun = "field" if len(names) == 1 else "fields"
        return ValidationFailed(f"The {noun} {quoted} {verb} required.", dict.fromkeys(names, "required"))
    name = str(first["loc"][-1]) if first["loc"] else "body"
    context = first.get("ctx") or {}
    if first["type"] == "interface_rule":
        return _ERROR_KINDS[context["kind"]](context["message"], {context["field"]: context["problem"]})
    if first["type"] == "literal_error":
        expected = str(context.get("expected", ""))
        return ValidationFailed(f"The field '{name}' must be {expected}.", {name: f"must be {expected}"})
    return ValidationFailed(f"The field '{name}' is invalid.", {name: str(first["msg"])[:200]})


# --- field rules ------------------------------------------------------------------------------------------

# The schemas state exactly what the rules accept. Flag strings are compared after str.strip() and lower();
# str.strip() also removes \x1c-\x1f and \x85, which a schema's \s need not match, hence the longer class.
_STRIPPED = "[\\s\\x1c-\\x1f\\x85]*"
_TRUE_WORDS = {"1", "true"}
_FALSE_WORDS = {"0", "false"}


def _flag_string(words: str) -> dict[str, Any]:
    return {"type": "string", "pattern": f"^({_STRIPPED}({words}){_STRIPPED})?$"}


def _flag(allow_words: bool) -> Callable[[object, ValidationInfo], bool]:
    accepted_true = _TRUE_WORDS if allow_words else {"1"}
    accepted_false = _FALSE_WORDS if allow_words else {"0"}
    allowed = "1, 0, true or false" if allow_words else "0 or 1"

    def validate(value: object, info: ValidationInfo) -> bool:
        if isinstance(value, bool):
            if allow_words:
                return value
        elif isinstance(value, int):
            if value in (0, 1):
                return bool(value)
        elif isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in accepted_true:
                return True
            if lowered in accepted_false:
                return False
        name = info.field_name or "flag"
        raise broken(f"The field '{name}' must be {allowed}.", name, f"must be {allowed}")

    return validate


# 1/0, true/false (JSON booleans, or the words in any case with surrounding blanks).
Flag = Annotated[
    bool,
    BeforeValidator(_flag(allow_words=True)),
    WithJsonSchema(
        {
            "oneOf": [
                {"type": "boolean"},
                {"type": "integer", "enum": [0, 1]},
                _flag_string("[01]|[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]"),
            ]
        }
    ),
]
# 0 or 1 only (age estimation's wait_for_result).
Flag01 = Annotated[bool, BeforeValidator(_flag(allow_words=False)), WithJsonSchema(_flag_string("[01]"))]


def _client_reference(value: object) -> str:
    if not isinstance(value, str):
        raise broken("client_reference must be a string.", "client_reference", "must be a string")
    if not 5 <= len(value) <= 255:
        raise broken(
            "client_reference must be 5 to 255 characters long.",
            "client_reference",
            "length must be 5 to 255",
        )
    if any(ord(char) < 32 for char in value):
        raise broken(
            "client_reference must not contain control characters.", "client_reference", "control characters"
        )
    return value


ClientReference = Annotated[
    str | None,
    BeforeValidator(_client_reference),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 255,
            "pattern": "^([^\\x00-\\x1f]{5,})?$",
            "description": "5 to 255 characters, no control characters; empty means absent",
        }
    ),
]


def _identifier(
    name: str, check: Callable[[object], bool], rule: str, label: str | None = None
) -> Callable[[object], str]:
    """label: how the message names the kind of value (the field name when None)."""

    def validate(value: object) -> str:
        if not check(value):
            raise broken(f"{name} is not a valid {label or name}.", name, rule)
        assert isinstance(value, str)
        return value

    return validate


ClientId = Annotated[
    str,
    BeforeValidator(
        _identifier("client_id", is_client_id, "must be cl_ followed by 24 hex digits", label="client id")
    ),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": CLIENT_ID_PATTERN,
            "description": "as issued: cl_ and 24 lowercase hex digits",
        }
    ),
]
ReferenceId = Annotated[
    str,
    BeforeValidator(_identifier("reference_id", is_reference_id, "must be 32 lowercase hex digits")),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": REFERENCE_ID_PATTERN,
            "description": "as returned by a create call: 32 lowercase hex digits",
        }
    ),
]
NonEmptyString = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]

_DATA_URI = re.compile(r"^data:image/(?P<subtype>[A-Za-z0-9.+-]+);base64,$")
_ACCEPTED_SUBTYPES = {"jpeg", "jpg", "png", "pjpeg"}


def _image_from_data_uri(value: object) -> bytes:
    if not isinstance(value, str):
        raise broken("'file' must be a data URI string.", "file", "must be a string")
    # The prefix is matched on the head alone: a regex over a multi-megabyte payload costs the ingress CPU.
    head, comma, payload = value.strip().partition(",")
    match = _DATA_URI.match(head[:100] + comma)
    if match is None:
        raise broken(
            "'file' must be a data URI with the prefix data:image/<subtype>;base64, "
            "(plain Base64 is rejected).",
            "file",
            "missing data URI prefix",
        )
    if match["subtype"].lower() not in _ACCEPTED_SUBTYPES:
        raise broken(
            f"Images of type image/{match['subtype']} are not accepted; send JPEG or PNG.",
            "file",
            "only image/jpeg and image/png",
            kind="unsupported",
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        # Line-wrapped Base64 (MIME style) is still Base64: drop the whitespace and try once more.
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise broken("'file' is not valid Base64.", "file", "invalid Base64") from None


@dataclass(frozen=True)
class Upload:
    """A file part of a form, read (up to the limit plus one byte) before validation."""

    filename: str
    data: bytes


def _image_from_upload(value: object, info: ValidationInfo) -> bytes:
    if not isinstance(value, Upload):
        raise broken("'file' must be an uploaded file.", "file", "must be a file part")
    if not value.filename.lower().endswith(ACCEPTED_EXTENSIONS):
        raise broken(
            "The uploaded file must be a .jpg, .jpeg or .png image.",
            "file",
            "extension must be .jpg/.jpeg/.png",
            kind="unsupported",
        )
    max_bytes = int((info.context or {})[MAX_UPLOAD_BYTES])
    if len(value.data) > max_bytes:
        raise broken(
            f"The uploaded file exceeds the limit of {max_bytes} bytes.",
            "file",
            "too large",
            kind="too_large",
        )
    return value.data


DataUriImage = Annotated[
    bytes,
    BeforeValidator(_image_from_data_uri),
    WithJsonSchema(
        {"type": "string", "pattern": "^data:image/(jpeg|jpg|png);base64,", "description": "Base64 data URI"}
    ),
]
UploadedImage = Annotated[
    bytes,
    BeforeValidator(_image_from_upload),
    WithJsonSchema({"type": "string", "format": "binary", "description": ".jpg, .jpeg or .png"}),
]


# --- bodies -----------------------------------------------------------------------------------------------


class InterfaceBody(BaseModel):
    """Common to every body: a null or an empty string counts as an absent field (forms cannot send null,
    and the interface's clients send "" for "not given"). Unknown fields are ignored, as the interface's
    examples carry fields this service does not use."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    # Fields for which "" is a value (then refused by its rule) rather than absent.
    blank_is_a_value: ClassVar[frozenset[str]] = frozenset()
    # Whether a 422 for an absent field names every absent field, or only the first.
    missing_together: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _drop_absent(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None and (value != "" or key in cls.blank_is_a_value)
        }


_ANNOTATIONS = ("title", "description", "default")


def _null_means_absent(schema: dict[str, Any]) -> None:
    """JSON schema of a JSON body: every optional field may also be null (see InterfaceBody)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name not in required:
            options = prop.pop("oneOf", None) or [
                {key: prop.pop(key) for key in list(prop) if key not in _ANNOTATIONS}
            ]
            prop["oneOf"] = [*options, {"type": "null"}]


class AccessTokenRequest(InterfaceBody):
    missing_together: ClassVar[bool] = True
    # client_secret first: with both wrong, an absent secret is reported before a malformed id.
    client_secret: NonEmptyString
    client_id: ClientId


class ResultRequest(InterfaceBody):
    reference_id: ReferenceId


class FaceSearchRequest(InterfaceBody):
    """Field order is the order rules are reported in."""

    blank_is_a_value: ClassVar[frozenset[str]] = frozenset({"type"})
    type: Literal["face_search"]
    allow_override: Flag = False
    file: bytes
    client_reference: ClientReference = None
    enroll_face: Flag = True

    @model_validator(mode="after")
    def _override_needs_a_reference(self) -> FaceSearchRequest:
        if self.allow_override and self.client_reference is None:
            raise broken(
                "client_reference is required when allow_override is 1.", "client_reference", "required"
            )
        return self


class FaceSearchJson(FaceSearchRequest):
    model_config = ConfigDict(json_schema_extra=_null_means_absent)
    file: DataUriImage


class FaceSearchForm(FaceSearchRequest):
    file: UploadedImage


class AgeEstimationRequest(InterfaceBody):
    blank_is_a_value: ClassVar[frozenset[str]] = frozenset({"type"})
    type: Literal["age_estimation"]
    enroll_face: Flag = True
    wait_for_result: Flag01 = False
    file: UploadedImage


Body = TypeVar("Body", bound=InterfaceBody)


def validate_body(model: type[Body], fields: dict[str, Any], max_upload_bytes: int = 0) -> Body:
    """Validate fields into model, raising the domain error of the first broken rule."""
    try:
        return model.model_validate(fields, context={MAX_UPLOAD_BYTES: max_upload_bytes})
    except ValidationError as error:
        raise as_service_error(error, model.missing_together) from None

"""The request bodies of the interface as pydantic models: each field rule is written once, here, as pydantic
constraints (`rule()`) that both check the value and generate the JSON Schema FastAPI publishes in
/openapi.json.

A JSON body and a multipart form validate into the same model: the form's parts arrive as strings and
`Upload`s, the JSON body's values as JSON types, and the subclasses for each media type differ only in how
the image arrives (a data URI or an uploaded file). A rule that fails raises the error `broken()` makes,
which carries the client-facing message, the field's problem and the status family; `validate_body` turns
the first one into the domain error that serve_app/api/errors.py maps to HTTP."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.types import Strict
from pydantic_core import PydanticCustomError

from serve_app.domain.errors import PayloadTooLarge, ServiceError, UnsupportedMedia, ValidationFailed
from serve_app.domain.identifiers import CLIENT_ID_PATTERN, REFERENCE_ID_PATTERN
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


def rule_error(problem: Mapping[str, Any]) -> ServiceError | None:
    """The domain error of a broken() rule in pydantic's error list (a body's or FastAPI's parameters'),
    or None for another error."""
    if problem.get("type") != "interface_rule":
        return None
    context = problem["ctx"]
    return _ERROR_KINDS[context["kind"]](context["message"], {context["field"]: context["problem"]})


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
    if (broken_rule := rule_error(first)) is not None:
        return broken_rule
    if first["type"] == "literal_error":
        expected = str(context.get("expected", ""))
        return ValidationFailed(f"The field '{name}' must be {expected}.", {name: f"must be {expected}"})
    return ValidationFailed(f"The field '{name}' is invalid.", {name: str(first["msg"])[:200]})


# --- field rules ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """The interface's words for a broken rule: the message ({field} names the field) and the problem."""

    message: str
    problem: str
    kind: str = "invalid"


def rule(
    wire: Any,
    otherwise: Problem,
    by_type: Mapping[str, Problem] | None = None,
    *,
    field: str | None = None,
    parse: Callable[[object], object] | None = None,
    convert: Callable[[Any, ValidationInfo], Any] | None = None,
) -> PlainValidator:
    """A field's rule, written once: `wire` is the value as it arrives, typed with pydantic constraints;
    pydantic checks them and generates the JSON Schema from them. A value that breaks them is reported
    in the interface's words (`by_type`, keyed by pydantic's error type, else `otherwise`). `parse` reads
    query text into the wire type; `convert` turns a valid wire value into the field's value and may
    refuse, with broken(), what a schema cannot state (a decodable Base64 payload, an upload's size)."""
    adapter: TypeAdapter[Any] = TypeAdapter(wire)
    problems = by_type or {}

    def validate(value: object, info: ValidationInfo) -> Any:
        try:
            checked = adapter.validate_python(parse(value) if parse is not None else value)
        except ValidationError as error:
            problem = problems.get(error.errors()[0]["type"], otherwise)
            name = field or info.field_name or "value"
            raise broken(problem.message.format(field=name), name, problem.problem, problem.kind) from None
        return convert(checked, info) if convert is not None else checked

    return PlainValidator(validate, json_schema_input_type=wire)


# Flag words are compared after str.strip() and lower(); str.strip() also removes \x1c-\x1f and \x85,
# which the pattern's \s (Unicode White_Space) need not match, hence the longer class.
_STRIPPED = "[\\s\\x1c-\\x1f\\x85]*"
_BIT = Annotated[int, Strict(), Field(ge=0, le=1)]


def _words(words: str) -> Any:
    return Annotated[str, StringConstraints(pattern=f"^{_STRIPPED}({words}){_STRIPPED}$")]


def _as_bool(value: bool | int | str, info: ValidationInfo) -> bool:
    return value.strip().lower() in ("1", "true") if isinstance(value, str) else bool(value)


# 1/0, true/false: JSON booleans, the integers, or the words in any case with surrounding blanks.
_FLAG_WIRE = StrictBool | _BIT | _words("[01]|[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]")
Flag = Annotated[
    bool,
    rule(
        _FLAG_WIRE,
        Problem("The field '{field}' must be 1, 0, true or false.", "must be 1, 0, true or false"),
        convert=_as_bool,
    ),
]
# 0 or 1 only (age estimation's wait_for_result).
Flag01 = Annotated[
    bool,
    rule(
        _BIT | _words("[01]"),
        Problem("The field '{field}' must be 0 or 1.", "must be 0 or 1"),
        convert=_as_bool,
    ),
]

_LENGTH = Problem("client_reference must be 5 to 255 characters long.", "length must be 5 to 255")
ClientReferenceText = Annotated[
    str, StringConstraints(min_length=5, max_length=255, pattern="^[^\\x00-\\x1f]*$")
]
CLIENT_REFERENCE_PROBLEMS: Mapping[str, Problem] = {
    "string_type": Problem("client_reference must be a string.", "must be a string"),
    "string_too_short": _LENGTH,
    "string_too_long": _LENGTH,
}
CONTROL_CHARACTERS = Problem("client_reference must not contain control characters.", "control characters")
ClientReference = Annotated[
    str | None,
    rule(ClientReferenceText, CONTROL_CHARACTERS, CLIENT_REFERENCE_PROBLEMS, field="client_reference"),
    Field(description="5 to 255 characters, no control characters"),
]
ClientId = Annotated[
    str,
    rule(
        Annotated[str, StringConstraints(pattern=CLIENT_ID_PATTERN)],
        Problem("client_id is not a valid client id.", "must be cl_ followed by 24 hex digits"),
        field="client_id",
    ),
    Field(description="as issued: cl_ and 24 lowercase hex digits"),
]
ReferenceId = Annotated[
    str,
    rule(
        Annotated[str, StringConstraints(pattern=REFERENCE_ID_PATTERN)],
        Problem("reference_id is not a valid reference_id.", "must be 32 lowercase hex digits"),
        field="reference_id",
    ),
    Field(description="as returned by a create call: 32 lowercase hex digits"),
]
NonEmptyString = Annotated[str, StringConstraints(min_length=1)]

_DATA_URI = re.compile(r"^data:image/(?P<subtype>[A-Za-z0-9.+-]+);base64,$")
_ACCEPTED_SUBTYPES = {"jpeg", "jpg", "png", "pjpeg"}
# The prefix only: a pattern over the whole multi-megabyte payload would cost the ingress CPU.
_DATA_URI_WIRE = Annotated[
    str, StringConstraints(pattern=f"^{_STRIPPED}data:image/[A-Za-z0-9.+-]{{1,82}};base64,")
]


_NO_PREFIX = Problem(
    "'file' must be a data URI with the prefix data:image/<subtype>;base64, (plain Base64 is rejected).",
    "missing data URI prefix",
)


def _image_from_data_uri(value: str, info: ValidationInfo) -> bytes:
    head, comma, payload = value.strip().partition(",")
    match = _DATA_URI.match(head[:100] + comma)
    if match is None:  # the wire pattern held, so only an over-long head gets here
        raise broken(_NO_PREFIX.message, "file", _NO_PREFIX.problem)
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
    rule(
        _DATA_URI_WIRE,
        _NO_PREFIX,
        {"string_type": Problem("'file' must be a data URI string.", "must be a string")},
        field="file",
        convert=_image_from_data_uri,
    ),
    Field(description="Base64 data URI of a JPEG or PNG image"),
]
# A file part: its JSON Schema is that of bytes (a binary string); the extension and size rules are the
# kind no schema states.
UploadedImage = Annotated[
    bytes,
    PlainValidator(_image_from_upload, json_schema_input_type=bytes),
    Field(description=".jpg, .jpeg or .png"),
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
    """The JSON body: the image as a data URI. An optional field sent as null or "" takes its default."""

    file: DataUriImage


class FaceSearchForm(FaceSearchRequest):
    """The multipart form: the image as a file part. An optional field sent as "" takes its default."""

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

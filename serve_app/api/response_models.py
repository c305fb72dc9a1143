"""The response bodies of the interface as pydantic models: the routes build their answers from these models
and declare them as `response_model`, so the OpenAPI document FastAPI generates describes what is sent.
Every body is the envelope {"status", "message", "result": {"data"}} or, for a failure, {"status": false,
"message", "errors"} (serve_app/api/errors.py); the error answers are documented from the one table below.

An extension field the interface does not list is left out of the body when it has no value (`exclude_if`),
so a client of the interface sees only its fields in the usual case."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from serve_app.api.json_response import JSONResponse

DataT = TypeVar("DataT")


def _absent(value: object) -> bool:
    return value is None


class Result(BaseModel, Generic[DataT]):
    data: DataT


class Envelope(BaseModel, Generic[DataT]):
    status: Literal[True]
    message: str
    result: Result[DataT]


def envelope(message: str, data: DataT) -> Envelope[DataT]:
    return Envelope(status=True, message=message, result=Result(data=data))


def respond(body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    """The answer of a route: its body model, rendered as the document's schema for it says."""
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code, headers=headers)


class ErrorEnvelope(BaseModel):
    status: Literal[False]
    message: str
    errors: dict[str, str]


class TokenData(BaseModel):
    token: str
    token_type: Literal["Bearer"] = "Bearer"
    expires_in: int


class CreatedData(BaseModel):
    reference_id: str


class PendingData(BaseModel):
    reference_id: str
    state: Literal["queued", "processing"]


class FailedData(BaseModel):
    reference_id: str
    state: Literal["failed"]


class FailedResult(BaseModel):
    data: FailedData


class FailedTransaction(BaseModel):
    """A transaction that ended `failed`: HTTP 200 with the error envelope plus its reference_id and state."""

    status: Literal[False]
    message: str
    errors: dict[str, str]
    result: FailedResult


# The first five are the quality bars' (models.quality); the rest name what widened an age interval
# (models.age_policy.QUALITY_TERMS; unmeasured: a measure is missing).
QualityReason = Literal[
    "small_face",
    "low_detector_score",
    "blurry",
    "extreme_pose",
    "below_search_bar",
    "dark",
    "low_contrast",
    "noisy",
    "compressed",
    "unmeasured",
]


class QualityReport(BaseModel):
    reasons: list[QualityReason]
    face_size_px: float | None = Field(default=None, description="shorter side of the face box")
    detector_score: float | None = None
    sharpness: float | None = Field(
        default=None, description="variance of the Laplacian of the aligned 112 px chip"
    )
    yaw: float | None = Field(
        default=None, description="0 frontal, about +-1 with the nose in an eye's column"
    )
    pitch: float | None = Field(default=None, description="nose between eye line (0) and mouth line (1)")
    roll_deg: float | None = None


class ProbeQuality(QualityReport):
    """Extension, present only when the probe misses the search quality bar: it was searched against a ten
    times stricter false-positive rate and its scores are capped at 0.5."""

    search_ok: Literal[False] = False


_UNINDEXED = (
    "Extension (like AWS IndexFaces' UnindexedFaces): present only when enrolment was asked for and the face "
    "missed the enrolment quality bar; the face was searched (face search) but not stored"
)
_MATCHES = (
    "[proof_id, score 0..1, proof URL (15 min), client_reference], best first; [] when none. "
    "score = -log10(FMR)/10: the per-comparison false-match rate calibrated on labelled photos (0.3: 1e-3, "
    "0.5: 1e-5, 0.8: 1e-8). By default only matches that keep the false-positive identification rate <= 1% "
    "for the tenant's gallery size are listed. client_reference is read from the face record when the "
    "result is read: a face erased, deleted or replaced since the search is left out"
)


class AgeDecision(BaseModel):
    """Extension, present only when under_18 or under_21 is 50: why the service did not decide."""

    reason: Literal["uncertain_age", "face_quality", "another_face"] = Field(
        description="uncertain_age: the age interval straddles the limit even for a clean photo (a better "
        "photo rarely helps); face_quality: the photo's quality (dark, low contrast, noisy, blurred, "
        "compressed, small, a doubtful detection, a turned head) widened the interval across the limit, "
        "ask for a better photo; another_face: another face as large as a quarter of the subject's could "
        "be under the limit, so a 0 is withheld; ask for a photo of the person alone"
    )
    quality: QualityReport | None = Field(
        default=None,
        description="the subject's measurements and what widened its age interval, worst first "
        "(face_quality)",
        exclude_if=_absent,
    )


class AgeData(BaseModel):
    reference_id: str
    age: int | None
    under_18: Literal[0, 50, 100] | None
    under_21: Literal[0, 50, 100] | None
    unindexed_faces: list[QualityReport] | None = Field(
        default=None, description=_UNINDEXED, exclude_if=_absent
    )
    age_decision: AgeDecision | None = Field(default=None, exclude_if=_absent)


class FaceSearchResult(BaseModel):
    matched_faces: list[tuple[str, float, str, str]] = Field(description=_MATCHES)
    is_face_found: bool
    unindexed_faces: list[QualityReport] | None = Field(
        default=None, description=_UNINDEXED, exclude_if=_absent
    )
    probe_quality: ProbeQuality | None = Field(default=None, exclude_if=_absent)


class FaceSearchResponse(BaseModel):
    result: FaceSearchResult


class FaceSearchData(BaseModel):
    service_reference_id: str
    client_reference: str = Field(
        description='the one sent with the transaction; "" when none was sent, or when that reference has '
        "been erased since the transaction was accepted"
    )
    face_search_response: FaceSearchResponse


# --- responses= tables ------------------------------------------------------------------------------------

_RETRY_AFTER = {"description": "Seconds before polling again", "schema": {"type": "integer"}}
_RETRY_LATER = {"description": "Seconds before trying again", "schema": {"type": "integer"}}
PREFERENCE_APPLIED = "Preference-Applied"
_PREFERENCE_APPLIED = {
    "description": "`wait=<seconds>` when the request's `Prefer: wait` was honoured: the server waited up "
    "to that long for the final state",
    "schema": {"type": "string"},
}
_ERROR_DESCRIPTIONS: dict[int, str] = {
    401: "Missing, invalid, expired or revoked credentials",
    404: "No such resource",
    410: "Gone",
    413: "Body or image over the size / pixel limit",
    415: "Wrong Content-Type or not a JPEG/PNG image",
    422: "A field is missing or breaks its rule",
    429: "Rate limited; see Retry-After",
    503: "Redis, Milvus or a model is unavailable; retry later. The message is fixed: what the backend said "
    "goes to the service log only",
    507: "The service's storage is full; nothing was created: retry after Retry-After",
}
Responses = dict[int | str, dict[str, Any]]


def error_responses(*codes: int, **descriptions: str) -> Responses:
    """The one definition of the error answers: the error envelope under each code, with the common
    description (s<code>=... replaces it). Routers declare the codes all their routes share, a route only
    those of its own."""
    table: Responses = {}
    for code in codes:
        entry: dict[str, Any] = {
            "model": ErrorEnvelope,
            "description": descriptions.get(f"s{code}", _ERROR_DESCRIPTIONS.get(code, "")),
        }
        if code in (429, 503, 507):
            entry["headers"] = {"Retry-After": _RETRY_LATER}
        table[code] = entry
    return table


def pending_response(
    long_polling: bool, description: str = "Not final yet: poll /result again after Retry-After seconds"
) -> Responses:
    headers = {"Retry-After": _RETRY_AFTER}
    if long_polling:
        headers[PREFERENCE_APPLIED] = _PREFERENCE_APPLIED
    return {202: {"model": Envelope[PendingData], "description": description, "headers": headers}}


PREFERENCE_APPLIED_HEADER = {PREFERENCE_APPLIED: _PREFERENCE_APPLIED}

"""The stored form of transaction outcomes. The layout is the one results had while they were plain dicts,
so records written before the outcomes were typed still read; `_enrolled` is that layout's name for
`enrolled`.

A match is stored as its face id and score only: the client_reference is joined from the face record when
the result is read (TransactionService.readable), so an erased reference is never kept in, nor returned
from, a stored result. A reference stored by an earlier version is ignored for the same reason.

One form, hash fields (outcome_fields), where every value stays short, so Redis keeps a finished
transaction's hash in its compact encoding (a listpack/ziplist holds values up to hash-max-listpack-value,
64 bytes by default): the outcome's document without its matches under "result", and each match as
"m<i>" = "<face_id> <score>". The result archive keeps the same fields (serve_app/stores/
transaction_codec.py). A document that still holds its matches (the form before the fields) reads too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from serve_app.domain.outcomes import (
    AgeDecisionReport,
    AgeEstimationOutcome,
    FaceMatch,
    FaceSearchOutcome,
    Outcome,
    QualityReport,
)
from serve_app.domain.transactions import TransactionKind

RESULT_FIELD = "result"
_MATCH_FIELD = "m"


def outcome_fields(outcome: Outcome) -> dict[str, str]:
    """The outcome as hash fields (see the module docstring)."""
    data = _to_json(outcome)
    matches = data.pop("matched_faces", [])
    fields = {RESULT_FIELD: _dumps(data)}
    for index, (face_id, score) in enumerate(matches):
        fields[f"{_MATCH_FIELD}{index}"] = f"{face_id} {score!r}"
    return fields


def outcome_from_fields(kind: TransactionKind, fields: Mapping[str, str]) -> Outcome | None:
    """The outcome stored as outcome_fields (or as one document under "result", the earlier form)."""
    text = fields.get(RESULT_FIELD)
    if text is None:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("a stored outcome must be a JSON object")
    if "matched_faces" not in data and kind is TransactionKind.FACE_SEARCH:
        matches: list[list[Any]] = []
        while (match := fields.get(f"{_MATCH_FIELD}{len(matches)}")) is not None:
            face_id, score = match.rsplit(" ", 1)
            matches.append([face_id, float(score)])
        data["matched_faces"] = matches
    return _from_json(kind, data)


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"))


def _to_json(outcome: Outcome) -> dict[str, Any]:
    data: dict[str, Any]
    if isinstance(outcome, FaceSearchOutcome):
        data = {
            "is_face_found": outcome.is_face_found,
            "matched_faces": [[m.face_id, m.score] for m in outcome.matches],
        }
        if outcome.probe_quality is not None:
            data["probe_quality"] = _quality_to_json(outcome.probe_quality)
    else:
        data = {"age": outcome.age, "under_18": outcome.under_18, "under_21": outcome.under_21}
        if outcome.age_decision is not None:
            data["age_decision"] = _decision_to_json(outcome.age_decision)
    if outcome.unindexed_faces:
        data["unindexed_faces"] = [_quality_to_json(face) for face in outcome.unindexed_faces]
    data["enrolled"] = outcome.enrolled
    return data


def _from_json(kind: TransactionKind, data: dict[str, Any]) -> Outcome:
    enrolled = bool(data.get("enrolled", data.get("_enrolled", False)))
    unindexed = tuple(_quality_from_json(face) for face in data.get("unindexed_faces", ()))
    if kind is TransactionKind.FACE_SEARCH:
        probe = data.get("probe_quality")
        return FaceSearchOutcome(
            is_face_found=bool(data["is_face_found"]),
            # [face_id, score], or the earlier [face_id, score, client_reference] whose reference is
            # ignored: it is joined from the face record when the result is read.
            matches=tuple(
                FaceMatch(face_id=str(match[0]), score=float(match[1]), client_reference="")
                for match in data.get("matched_faces", ())
            ),
            probe_quality=_quality_from_json(probe) if probe is not None else None,
            unindexed_faces=unindexed,
            enrolled=enrolled,
        )
    decision = data.get("age_decision")
    return AgeEstimationOutcome(
        age=_optional_int(data.get("age")),
        under_18=_optional_int(data.get("under_18")),
        under_21=_optional_int(data.get("under_21")),
        unindexed_faces=unindexed,
        enrolled=enrolled,
        age_decision=_decision_from_json(decision) if decision is not None else None,
    )


def _decision_to_json(decision: AgeDecisionReport) -> dict[str, Any]:
    data: dict[str, Any] = {"reason": decision.reason}
    if decision.quality is not None:
        data["quality"] = _quality_to_json(decision.quality)
    return data


def _decision_from_json(data: dict[str, Any]) -> AgeDecisionReport:
    quality = data.get("quality")
    return AgeDecisionReport(
        reason=str(data["reason"]), quality=_quality_from_json(quality) if quality is not None else None
    )


def _quality_to_json(quality: QualityReport) -> dict[str, Any]:
    return dataclasses.asdict(quality)  # its fields by name; json writes the reasons' tuple as a list


def _quality_from_json(data: dict[str, Any]) -> QualityReport:
    return QualityReport(
        reasons=tuple(str(reason) for reason in data["reasons"]),
        face_size_px=float(data["face_size_px"]),
        detector_score=float(data["detector_score"]),
        sharpness=float(data["sharpness"]),
        yaw=float(data["yaw"]),
        pitch=float(data["pitch"]),
        roll_deg=float(data["roll_deg"]),
    )


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return int(value)
    raise ValueError(f"not an integer: {value!r}")

"""Typed outcomes: their stored form round-trips (without the matches' references), the form of results
stored before the outcomes were typed still reads, and the API alone renders the interface's shapes from
them, through the answer /result gives."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from serve_app.api.results import result_response
from serve_app.api.tokens import TokenSigner
from serve_app.domain.outcomes import (
    AgeDecisionReport,
    AgeEstimationOutcome,
    FaceMatch,
    FaceSearchOutcome,
    Outcome,
    QualityReport,
)
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState
from serve_app.stores.outcome_codec import RESULT_FIELD, outcome_fields, outcome_from_fields
from tests.unit.fakes import build_api

BLURRY = QualityReport(
    reasons=("blurry",),
    face_size_px=80.5,
    detector_score=0.912,
    sharpness=12.3,
    yaw=0.05,
    pitch=0.4,
    roll_deg=-3.5,
)
SMALL = QualityReport(
    reasons=("small_face", "blurry"),
    face_size_px=20.0,
    detector_score=0.5,
    sharpness=1.0,
    yaw=0.0,
    pitch=0.5,
    roll_deg=0.0,
)
SEARCHES = [
    FaceSearchOutcome(is_face_found=False),
    FaceSearchOutcome(
        is_face_found=True,
        matches=(FaceMatch("f" + "1" * 32, 0.987654, 'customer \U0001f600 "q"'), FaceMatch("f2", 0.31, "")),
        enrolled=True,
    ),
    FaceSearchOutcome(is_face_found=True, probe_quality=SMALL, unindexed_faces=(SMALL,), enrolled=False),
]
AGES = [
    AgeEstimationOutcome(age=None, under_18=None, under_21=None),
    AgeEstimationOutcome(age=17, under_18=50, under_21=100, enrolled=True),
    AgeEstimationOutcome(age=30, under_18=0, under_21=0, unindexed_faces=(BLURRY,)),
    AgeEstimationOutcome(
        age=30, under_18=50, under_21=50, age_decision=AgeDecisionReport("face_quality", quality=BLURRY)
    ),
    AgeEstimationOutcome(age=30, under_18=50, under_21=50, age_decision=AgeDecisionReport("another_face")),
]


def kind_of(outcome: Outcome) -> TransactionKind:
    if isinstance(outcome, FaceSearchOutcome):
        return TransactionKind.FACE_SEARCH
    return TransactionKind.AGE_ESTIMATION


def as_stored(outcome: Outcome) -> Outcome:
    """What a store keeps: a match's face id and score, never its client_reference (joined when read)."""
    if isinstance(outcome, FaceSearchOutcome):
        matches = tuple(dataclasses.replace(match, client_reference="") for match in outcome.matches)
        return dataclasses.replace(outcome, matches=matches)
    return outcome


@pytest.mark.parametrize("outcome", [*SEARCHES, *AGES], ids=lambda outcome: repr(outcome)[:60])
def test_an_outcome_round_trips_through_its_stored_form(outcome: Outcome) -> None:
    fields = outcome_fields(outcome)
    assert outcome_from_fields(kind_of(outcome), fields) == as_stored(outcome)
    assert not any(key.startswith("_") for key in json.loads(fields[RESULT_FIELD]))
    # An erasable reference is never part of a stored result.
    assert "customer" not in repr(fields)


def test_a_typical_search_result_is_stored_as_short_hash_fields() -> None:
    """Every value within Redis' compact-encoding bound (hash-max-listpack-value, 64 bytes by default)."""
    matches = tuple(FaceMatch(f"f{index:032x}", 0.873215 - index / 100, "customer") for index in range(10))
    fields = outcome_fields(FaceSearchOutcome(is_face_found=True, matches=matches, enrolled=True))
    assert len(fields) == 11
    assert max(len(value.encode()) for value in fields.values()) <= 64
    age = outcome_fields(AgeEstimationOutcome(age=31, under_18=0, under_21=0, enrolled=True))
    assert max(len(value.encode()) for value in age.values()) <= 64


def test_results_stored_as_plain_dicts_before_the_outcomes_were_typed_still_read() -> None:
    legacy_search = {
        "is_face_found": True,
        "matched_faces": [["fabc", 0.5, "ref-1"]],
        "probe_quality": {
            "search_ok": False,
            "reasons": ["small_face", "blurry"],
            "face_size_px": 20.0,
            "detector_score": 0.5,
            "sharpness": 1.0,
            "yaw": 0.0,
            "pitch": 0.5,
            "roll_deg": 0.0,
        },
        "_enrolled": True,
    }
    stored_search = {RESULT_FIELD: json.dumps(legacy_search)}
    assert outcome_from_fields(TransactionKind.FACE_SEARCH, stored_search) == FaceSearchOutcome(
        is_face_found=True, matches=(FaceMatch("fabc", 0.5, ""),), probe_quality=SMALL, enrolled=True
    )  # the reference stored then is not read: it is joined from the face record
    legacy_age = {"age": 17, "under_18": 50, "under_21": 100, "_enrolled": False}
    stored_age = {RESULT_FIELD: json.dumps(legacy_age)}
    assert outcome_from_fields(TransactionKind.AGE_ESTIMATION, stored_age) == AgeEstimationOutcome(
        age=17, under_18=50, under_21=100
    )


def completed(kind: TransactionKind, outcome: Outcome, client_reference: str | None = None) -> Transaction:
    return Transaction(
        reference_id="a" * 32,
        tenant_id="cl_" + "b" * 24,
        kind=kind,
        state=TransactionState.COMPLETED,
        created_at=1.0,
        updated_at=2.0,
        image_key="uploads/x",
        enroll_face=True,
        client_reference=client_reference,
        result=outcome,
    )


def render_outcome(tx: Transaction, outcome: Outcome, base: str, signer: TokenSigner) -> dict[str, Any]:
    """result.data of the answer /result gives for tx completed with outcome."""
    response = result_response(dataclasses.replace(tx, result=outcome), base, signer, created=False)
    data: dict[str, Any] = json.loads(bytes(response.body))["result"]["data"]
    return data


def test_the_api_renders_the_interfaces_face_search_shape_with_fresh_proof_urls() -> None:
    signer = TokenSigner("secret", 60, 900)
    outcome = SEARCHES[1]
    tx = completed(TransactionKind.FACE_SEARCH, outcome, client_reference="mine")
    rendered = render_outcome(tx, outcome, "http://127.0.0.1:8000", signer)
    assert list(rendered) == ["service_reference_id", "client_reference", "face_search_response"]
    assert rendered["service_reference_id"] == tx.reference_id and rendered["client_reference"] == "mine"
    result = rendered["face_search_response"]["result"]
    assert list(result) == ["matched_faces", "is_face_found"] and result["is_face_found"] is True
    for entry, match in zip(result["matched_faces"], outcome.matches, strict=True):
        face_id, score, url, reference = entry
        assert (face_id, score, reference) == (match.face_id, match.score, match.client_reference)
        prefix = "http://127.0.0.1:8000/get-proof/"
        assert url.startswith(prefix)
        claims = signer.verify_proof(url.removeprefix(prefix))
        assert (claims.tenant_id, claims.face_id) == (tx.tenant_id, match.face_id)
    nothing = render_outcome(tx, SEARCHES[0], "http://h", signer)
    assert nothing["face_search_response"] == {"result": {"matched_faces": [], "is_face_found": False}}
    no_reference = completed(TransactionKind.FACE_SEARCH, SEARCHES[0])
    assert render_outcome(no_reference, SEARCHES[0], "http://h", signer)["client_reference"] == ""


def test_the_api_renders_the_age_shape_with_unindexed_faces_only_when_there_are_some() -> None:
    signer = TokenSigner("secret", 60, 900)
    tx = completed(TransactionKind.AGE_ESTIMATION, AGES[0])
    assert render_outcome(tx, AGES[0], "http://h", signer) == {
        "reference_id": tx.reference_id,
        "age": None,
        "under_18": None,
        "under_21": None,
    }
    assert render_outcome(tx, AGES[1], "http://h", signer) == {
        "reference_id": tx.reference_id,
        "age": 17,
        "under_18": 50,
        "under_21": 100,
    }
    assert render_outcome(tx, AGES[2], "http://h", signer) == {
        "reference_id": tx.reference_id,
        "age": 30,
        "under_18": 0,
        "under_21": 0,
        "unindexed_faces": [
            {
                "reasons": ["blurry"],
                "face_size_px": 80.5,
                "detector_score": 0.912,
                "sharpness": 12.3,
                "yaw": 0.05,
                "pitch": 0.4,
                "roll_deg": -3.5,
            }
        ],
    }


def test_an_age_result_with_a_50_says_why_in_the_age_decision_extension() -> None:
    signer = TokenSigner("secret", 60, 900)
    tx = completed(TransactionKind.AGE_ESTIMATION, AGES[3])
    measured = {
        "reasons": ["blurry"],
        "face_size_px": 80.5,
        "detector_score": 0.912,
        "sharpness": 12.3,
        "yaw": 0.05,
        "pitch": 0.4,
        "roll_deg": -3.5,
    }
    assert render_outcome(tx, AGES[3], "http://h", signer) == {
        "reference_id": tx.reference_id,
        "age": 30,
        "under_18": 50,
        "under_21": 50,
        "age_decision": {"reason": "face_quality", "quality": measured},
    }
    rendered = render_outcome(tx, AGES[4], "http://h", signer)
    assert rendered["age_decision"] == {"reason": "another_face"}


def test_a_face_search_that_missed_a_quality_bar_carries_the_quality_extensions() -> None:
    signer = TokenSigner("secret", 60, 900)
    outcome = SEARCHES[2]
    tx = completed(TransactionKind.FACE_SEARCH, outcome)
    result = render_outcome(tx, outcome, "http://h", signer)["face_search_response"]["result"]
    measured = {
        "reasons": ["small_face", "blurry"],
        "face_size_px": 20.0,
        "detector_score": 0.5,
        "sharpness": 1.0,
        "yaw": 0.0,
        "pitch": 0.5,
        "roll_deg": 0.0,
    }
    assert result == {
        "matched_faces": [],
        "is_face_found": True,
        "unindexed_faces": [measured],
        "probe_quality": {**measured, "search_ok": False},
    }


def test_openapi_documents_the_age_decision_extension() -> None:
    async def scenario() -> dict[str, Any]:
        api = await build_api()
        async with api.http() as http:
            return dict((await http.get("/openapi.json")).json())

    schemas = asyncio.run(scenario())["components"]["schemas"]
    age_data = schemas["AgeData"]["properties"]
    assert "age_decision" in age_data and "age_decision" not in schemas["AgeData"].get("required", [])
    reason = schemas["AgeDecision"]["properties"]["reason"]
    assert sorted(reason["enum"]) == ["another_face", "face_quality", "uncertain_age"]
    assert "face_quality" in reason["description"]

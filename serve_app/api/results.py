"""The wire format of transaction results: the one place that turns typed outcomes into the interface's
shapes (match quadruples with fresh proof URLs), through the response models the OpenAPI document shows."""

from __future__ import annotations

import dataclasses
from typing import Any

from serve_app.api.json_response import JSONResponse
from serve_app.api.response_models import (
    AgeData,
    FaceSearchData,
    FaceSearchResponse,
    FaceSearchResult,
    FailedData,
    FailedResult,
    FailedTransaction,
    PendingData,
    ProbeQuality,
    QualityReport,
    envelope,
    respond,
)
from serve_app.api.tokens import TokenSigner
from serve_app.domain import outcomes
from serve_app.domain.transactions import Transaction, TransactionState


def result_response(tx: Transaction, base: str, signer: TokenSigner, created: bool) -> JSONResponse:
    if not tx.state.is_final:
        message = (
            "Transaction created; the result was not ready in time. Poll /result with the reference_id."
            if created
            else "The transaction is still being processed; poll again."
        )
        pending = PendingData(reference_id=tx.reference_id, state=tx.state.value)
        return respond(envelope(message, pending), status_code=202, headers={"Retry-After": "1"})
    if tx.state is TransactionState.FAILED:
        failed = FailedTransaction(
            status=False,
            message=f"The transaction failed: {tx.error}",
            errors={"transaction": tx.error or "failed"},
            result=FailedResult(data=FailedData(reference_id=tx.reference_id, state=tx.state.value)),
        )
        return respond(failed)
    if tx.result is None:
        # complete() always stores the outcome; a completed record without one is a bug (a 500, logged).
        raise RuntimeError(f"completed transaction {tx.reference_id} has no outcome")
    return respond(envelope("Transaction result.", outcome_data(tx, tx.result, base, signer)))


def render_outcome(
    tx: Transaction, outcome: outcomes.Outcome, base: str, signer: TokenSigner
) -> dict[str, Any]:
    """result.data of a final transaction as it goes on the wire."""
    return outcome_data(tx, outcome, base, signer).model_dump(mode="json")


def outcome_data(
    tx: Transaction, outcome: outcomes.Outcome, base: str, signer: TokenSigner
) -> AgeData | FaceSearchData:
    if isinstance(outcome, outcomes.AgeEstimationOutcome):
        data: dict[str, Any] = {
            "reference_id": tx.reference_id,
            "age": outcome.age,
            "under_18": outcome.under_18,
            "under_21": outcome.under_21,
        }
        if outcome.unindexed_faces:  # an extension field, present only when a face was not enrolled
            data["unindexed_faces"] = [dataclasses.asdict(face) for face in outcome.unindexed_faces]
        if outcome.age_decision is not None:  # an extension field, present only when a flag is 50
            data["age_decision"] = dataclasses.asdict(outcome.age_decision)
            if outcome.age_decision.quality is None:
                del data["age_decision"]["quality"]
        return AgeData.model_validate(data)
    matched = [
        (
            match.face_id,
            match.score,
            f"{base}/get-proof/{signer.issue_proof(tx.tenant_id, match.face_id)}",
            match.client_reference,
        )
        for match in outcome.matches
    ]
    # The quality extensions are given only when a bar was missed (response_models leaves them out else).
    extensions: dict[str, Any] = {}
    if outcome.unindexed_faces:
        extensions["unindexed_faces"] = [
            QualityReport.model_validate(dataclasses.asdict(face)) for face in outcome.unindexed_faces
        ]
    if outcome.probe_quality is not None:
        extensions["probe_quality"] = ProbeQuality.model_validate(
            {**dataclasses.asdict(outcome.probe_quality), "search_ok": False}
        )
    result = FaceSearchResult(matched_faces=matched, is_face_found=outcome.is_face_found, **extensions)
    return FaceSearchData(
        service_reference_id=tx.reference_id,
        client_reference=tx.client_reference or "",
        face_search_response=FaceSearchResponse(result=result),
    )

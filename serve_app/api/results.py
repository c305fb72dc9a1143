"""The wire format of transaction results: the one place that turns typed outcomes into the interface's
shapes (match quadruples with fresh proof URLs), through the response models the OpenAPI document shows."""

from __future__ import annotations

import dataclasses

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


def outcome_data(
    tx: Transaction, outcome: outcomes.Outcome, base: str, signer: TokenSigner
) -> AgeData | FaceSearchData:
    """The outcome as its response model. The outcome's fields carry over by name (pydantic reads the
    dataclasses' attributes, nested ones too); only the interface's own shapes are made here: the match
    quadruples with fresh proof URLs, the ids, and the extensions left out when empty."""
    fields = {field.name: getattr(outcome, field.name) for field in dataclasses.fields(outcome)}
    fields["unindexed_faces"] = outcome.unindexed_faces or None
    if isinstance(outcome, outcomes.AgeEstimationOutcome):
        return AgeData.model_validate({**fields, "reference_id": tx.reference_id}, from_attributes=True)
    fields["matched_faces"] = [
        (
            match.face_id,
            match.score,
            f"{base}/get-proof/{signer.issue_proof(tx.tenant_id, match.face_id)}",
            match.client_reference,
        )
        for match in outcome.matches
    ]
    return FaceSearchData(
        service_reference_id=tx.reference_id,
        client_reference=tx.client_reference or "",
        face_search_response=FaceSearchResponse(
            result=FaceSearchResult.model_validate(fields, from_attributes=True)
        ),
    )

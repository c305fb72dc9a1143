"""The transactions: POST /face-search and /age-estimation create one, POST /result reads it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

from serve_app.api import parsing
from serve_app.api.dependencies import ApiServices, Services, Tenant, base_url
from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import (
    AgeEstimationRequest,
    FaceSearchForm,
    FaceSearchJson,
    FaceSearchRequest,
    ResultRequest,
    validate_body,
)
from serve_app.api.response_models import (
    PREFERENCE_APPLIED,
    PREFERENCE_APPLIED_HEADER,
    AgeData,
    CreatedData,
    Envelope,
    FaceSearchData,
    FailedTransaction,
    envelope,
    error_responses,
    pending_response,
    respond,
)
from serve_app.api.results import result_response
from serve_app.api.routes.bodies import request_body
from serve_app.domain.idempotency import HEADER, parse_key
from serve_app.domain.transactions import Transaction
from serve_app.pipelines.commands import AgeEstimationCommand, FaceSearchCommand

# A /result body names one reference_id.
_MAX_RESULT_BODY_BYTES = 4096

# RFC 7240's Prefer: declared as plain strings, so any value is accepted (the RFC has servers ignore a
# preference they cannot parse); parsing.preferred_wait_s reads the wait from it.
Prefer = Annotated[
    tuple[str, ...],
    Header(
        alias="Prefer",
        description="RFC 7240 `wait=<seconds>`, e.g. `wait=5`: hold the request until the transaction is "
        "final or the wait (capped by the server's wait_for_result bound, 10 s by default) runs out, "
        "instead of answering 202 at once. Answers carry `Preference-Applied` when honoured. Other "
        "preferences are ignored.",
    ),
]
# The same header on the creates: one request per transaction when the result is ready in time.
CreatePrefer = Annotated[
    tuple[str, ...],
    Header(
        alias="Prefer",
        description="RFC 7240 `wait=<seconds>`, e.g. `wait=10`: after creating the transaction, hold the "
        "request until it is final or the wait (capped by the server's wait_for_result bound, 10 s by "
        "default) runs out. Final in time: the body is the result, as `/result` answers it (the "
        "failed-transaction envelope for a failed one). Otherwise the body is the create's own "
        "(`reference_id`; poll `/result` with it). Either way the answer carries `Preference-Applied: "
        "wait=<seconds applied>`. Other preferences are ignored.",
    ),
]

# The IETF httpapi draft's Idempotency-Key (domain/idempotency.py has the rules): declared so OpenAPI shows
# it; its value is checked there, so a malformed one gets the service's envelope.
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias=HEADER,
        description="A key naming this logical request (e.g. a UUID, as a Structured Field string "
        '`"..."` or bare; 1-255 visible ASCII characters), sent again unchanged on every retry. For 24 '
        "hours after the first request (FACESEARCH_IDEMPOTENCY_KEY_TTL_S), the same key with the same "
        "request (tenant, type, fields, image bytes) answers with the first request's reference_id and "
        "creates nothing; with a different request it is refused with 422. Without it, every request "
        "creates a transaction.",
    ),
]


async def face_search_body(request: Request, services: Services) -> FaceSearchRequest:
    fields = await parsing.read_fields(request, (parsing.JSON, parsing.MULTIPART), services.max_upload_bytes)
    model = FaceSearchJson if parsing.media_type(request) == parsing.JSON else FaceSearchForm
    return validate_body(model, fields, services.max_upload_bytes)


async def age_estimation_body(request: Request, services: Services) -> AgeEstimationRequest:
    fields = await parsing.read_fields(request, (parsing.MULTIPART,), services.max_upload_bytes)
    return validate_body(AgeEstimationRequest, fields, services.max_upload_bytes)


async def result_body(request: Request) -> ResultRequest:
    accepted = (parsing.JSON, parsing.URLENCODED, parsing.MULTIPART)
    fields = await parsing.read_fields(request, accepted, _MAX_RESULT_BODY_BYTES)
    body = validate_body(ResultRequest, fields)
    request.state.reference_id = body.reference_id  # for the log line of an error answer
    return body


_PENDING_AFTER_WAIT_FOR_RESULT = (
    "wait_for_result=1 and not final in time: poll /result after Retry-After seconds"
)


async def created_answer(
    request: Request,
    services: ApiServices,
    tx: Transaction,
    message: str,
    wait_s: float,
    *,
    preferred: bool,
    pending_as_202: bool = False,
) -> JSONResponse:
    """The answer to a create: with a wait (Prefer: wait, or wait_for_result=1), the result once the
    transaction is final within it; otherwise, and when it is not, the create's own envelope, or with
    pending_as_202 (wait_for_result=1) the 202 that /result answers for a transaction still pending.
    `preferred`: the wait came from the Prefer header, so the answer says it was applied."""
    if wait_s <= 0:
        return respond(envelope(message, CreatedData(reference_id=tx.reference_id)))
    tx = await services.transactions.wait_final(tx, wait_s)
    if tx.state.is_final or pending_as_202:
        tx = await services.transactions.readable(tx)
        response = result_response(tx, base_url(request, services), services.signer, created=True)
    else:
        response = respond(envelope(message, CreatedData(reference_id=tx.reference_id)))
    if preferred:
        response.headers[PREFERENCE_APPLIED] = f"wait={wait_s:g}"
    return response


def router() -> APIRouter:
    routes = APIRouter(tags=["transactions"], responses=error_responses(401, 415, 422, 429, 503))

    @routes.post(
        "/face-search",
        summary="Search the tenant's gallery for the largest face (1:N), and enrol it",
        openapi_extra=request_body({parsing.JSON: FaceSearchJson, parsing.MULTIPART: FaceSearchForm}),
        response_model=Envelope[CreatedData | FaceSearchData] | FailedTransaction,
        responses={
            200: {
                "description": "Transaction created (data: reference_id); with `Prefer: wait` and a result "
                "final in time, the result itself (face search data, or the failed-transaction envelope)",
                "headers": PREFERENCE_APPLIED_HEADER,
            },
            **error_responses(413, 507),
        },
    )
    async def face_search(
        request: Request,
        tenant: Tenant,
        body: Annotated[FaceSearchRequest, Depends(face_search_body)],
        services: Services,
        idempotency_key: IdempotencyKey = None,
        prefer: CreatePrefer = (),
    ) -> JSONResponse:
        command = FaceSearchCommand(
            tenant_id=tenant,
            image=body.file,
            client_reference=body.client_reference,
            allow_override=body.allow_override,
            enroll_face=body.enroll_face,
        )
        wait_s = parsing.preferred_wait_s(prefer, services.wait_for_result_timeout_s)
        tx = await services.transactions.create_face_search(command, parse_key(idempotency_key))
        return await created_answer(
            request, services, tx, "Face search transaction created.", wait_s, preferred=wait_s > 0
        )

    @routes.post(
        "/age-estimation",
        summary="Estimate the age of the largest face",
        openapi_extra=request_body({parsing.MULTIPART: AgeEstimationRequest}),
        response_model=Envelope[CreatedData | AgeData] | FailedTransaction,
        responses={
            200: {
                "description": "Transaction created (data: reference_id); with wait_for_result=1 or "
                "`Prefer: wait` and a result final in time, the result itself (the age result, or the "
                "failed-transaction envelope)",
                "headers": PREFERENCE_APPLIED_HEADER,
            },
            **pending_response(long_polling=False, description=_PENDING_AFTER_WAIT_FOR_RESULT),
            **error_responses(413, 507),
        },
    )
    async def age_estimation(
        request: Request,
        tenant: Tenant,
        body: Annotated[AgeEstimationRequest, Depends(age_estimation_body)],
        services: Services,
        idempotency_key: IdempotencyKey = None,
        prefer: CreatePrefer = (),
    ) -> JSONResponse:
        preferred_s = parsing.preferred_wait_s(prefer, services.wait_for_result_timeout_s)
        # The preference says how long; wait_for_result=1 alone waits the whole bound.
        wait_s = preferred_s or (services.wait_for_result_timeout_s if body.wait_for_result else 0.0)
        tx = await services.transactions.create_age_estimation(
            AgeEstimationCommand(tenant_id=tenant, image=body.file, enroll_face=body.enroll_face),
            parse_key(idempotency_key),
        )
        return await created_answer(
            request,
            services,
            tx,
            "Age estimation transaction created.",
            wait_s,
            preferred=preferred_s > 0,
            pending_as_202=body.wait_for_result,
        )

    @routes.post(
        "/result",
        summary="The state or the outcome of a transaction",
        openapi_extra=request_body({parsing.JSON: ResultRequest, parsing.URLENCODED: ResultRequest}),
        response_model=Envelope[FaceSearchData | AgeData] | FailedTransaction,
        responses={
            200: {
                "description": "Final result (face search or age estimation data), or the failed-transaction "
                "envelope (status false, errors.transaction, result.data.state = failed)",
                "headers": PREFERENCE_APPLIED_HEADER,
            },
            **pending_response(long_polling=True),
        },
    )
    async def result(
        request: Request,
        tenant: Tenant,
        body: Annotated[ResultRequest, Depends(result_body)],
        services: Services,
        prefer: Prefer = (),
    ) -> JSONResponse:
        tx = await services.transactions.get_for_tenant(tenant, body.reference_id)
        # Long polling: one held request replaces the several polls a client would otherwise send.
        wait_s = parsing.preferred_wait_s(prefer, services.wait_for_result_timeout_s)
        if wait_s > 0 and not tx.state.is_final:
            tx = await services.transactions.wait_final(tx, wait_s)
        tx = await services.transactions.readable(tx)
        response = result_response(tx, base_url(request, services), services.signer, created=False)
        if wait_s > 0:
            response.headers[PREFERENCE_APPLIED] = f"wait={wait_s:g}"
        return response

    return routes

"""POST /request-access-token: a client's id and secret for a short-lived bearer token."""

from __future__ import annotations

from fastapi import APIRouter, Request

from serve_app.api import parsing
from serve_app.api.dependencies import Services, source_of
from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import AccessTokenRequest, validate_body
from serve_app.api.response_models import Envelope, TokenData, envelope, error_responses, respond
from serve_app.api.routes.bodies import request_body

# Small bodies only: an id and a secret.
_MAX_BODY_BYTES = 4096


def router() -> APIRouter:
    routes = APIRouter(
        tags=["auth"],
        responses=error_responses(
            401,
            415,
            422,
            429,
            503,
            s429="Too many failed logins for this client_id from this address (each attempt past the "
            "allowance waits twice as long as the one before), or too many unauthenticated requests "
            "from this address; see Retry-After",
        ),
    )

    @routes.post(
        "/request-access-token",
        summary="Exchange client credentials for an access token",
        openapi_extra=request_body(
            {parsing.JSON: AccessTokenRequest, parsing.URLENCODED: AccessTokenRequest}
        ),
        response_model=Envelope[TokenData],
        responses={200: {"description": "Access token"}},
    )
    async def request_access_token(request: Request, services: Services) -> JSONResponse:
        source = source_of(request, services)
        await services.auth.count_unauthenticated(source)
        fields = await parsing.read_fields(
            request, (parsing.JSON, parsing.URLENCODED, parsing.MULTIPART), _MAX_BODY_BYTES
        )
        body = validate_body(AccessTokenRequest, fields)
        client = await services.auth.login(body.client_id, body.client_secret, source)
        token, expires_in = services.signer.issue_access(client.client_id)
        return respond(envelope("Access token issued.", TokenData(token=token, expires_in=expires_in)))

    return routes

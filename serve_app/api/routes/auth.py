"""POST /request-access-token: a client's id and secret for a short-lived bearer token."""

from __future__ import annotations

from fastapi import APIRouter, Request

from serve_app.api import parsing
from serve_app.api.dependencies import Services, source_of
from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import AccessTokenRequest, validate_body
from serve_app.api.response_models import Envelope, TokenData, error_responses
from serve_app.api.routes.bodies import envelope, request_body

# Small bodies only: an id and a secret.
_MAX_BODY_BYTES = 4096


def router() -> APIRouter:
    routes = APIRouter(tags=["auth"])

    @routes.post(
        "/request-access-token",
        summary="Exchange client credentials for an access token",
        openapi_extra=request_body(
            {parsing.JSON: AccessTokenRequest, parsing.URLENCODED: AccessTokenRequest}
        ),
        responses={
            200: {"model": Envelope[TokenData], "description": "Access token"},
            **error_responses(
                415,
                422,
                401,
                503,
                429,
                s429="Too many failed logins for this client_id from this address (each attempt past the "
                "allowance waits twice as long as the one before), or too many unauthenticated requests "
                "from this address; see Retry-After",
            ),
        },
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
        data = TokenData(token=token, expires_in=expires_in)
        return JSONResponse(envelope("Access token issued.", data.model_dump()))

    return routes

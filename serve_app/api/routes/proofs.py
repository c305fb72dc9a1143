"""GET /get-proof/{token}: the enrolled image behind a match, while its signed URL is fresh."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve_app.api.dependencies import Services, source_of
from serve_app.api.response_models import error_responses
from serve_app.domain.errors import NotFound, ProofExpired
from serve_app.domain.identifiers import is_proof_token


def router() -> APIRouter:
    routes = APIRouter(
        tags=["proofs"],
        # 422: FastAPI would otherwise document its own body for the path parameter; ours is the envelope.
        responses=error_responses(
            404,
            410,
            422,
            429,
            503,
            s404="Invalid or tampered token, or the face was replaced",
            s410="The proof URL expired (15 minutes after issue)",
            s429="Too many invalid proof URLs, failed logins or failed credentials from this address; see "
            "Retry-After",
        ),
    )

    # The one route whose success is not JSON: an image, documented by its media types.
    @routes.get(
        "/get-proof/{proof_token}",
        summary="The enrolled image of a matched face",
        response_class=Response,
        responses={
            200: {"description": "The enrolled image", "content": {"image/jpeg": {}, "image/png": {}}}
        },
    )
    async def get_proof(proof_token: str, request: Request, services: Services) -> Response:
        try:
            if not is_proof_token(proof_token):
                # A URL that names no proof: 404 like any tampered token (the proof URL contract).
                raise NotFound("No proof image exists for this URL.")
            claims = services.signer.verify_proof(proof_token)
            data, content_type = await services.proofs.load(claims.tenant_id, claims.face_id)
        except (NotFound, ProofExpired):
            # The URL is the credential here: a failed one counts like failed credentials elsewhere.
            await services.auth.count_unauthenticated(source_of(request, services))
            raise
        remaining = max(0, claims.expires_at - int(time.time()))
        return Response(
            data, media_type=content_type, headers={"Cache-Control": f"private, max-age={remaining}"}
        )

    return routes

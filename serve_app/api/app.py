"""The REST interface (see ../shared/INTERFACE.md and the README). Built per replica by create_app()."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.api import errors, parsing
from serve_app.api.console import mount_console
from serve_app.api.gallery import gallery_router
from serve_app.api.limits import BodySizeLimitMiddleware, IPNetwork, client_source
from serve_app.api.openapi import REQUEST_BODIES, RESPONSES, describe
from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import (
    AuthenticationFailed,
    NotFound,
    ProofExpired,
    ServiceError,
    ValidationFailed,
)
from serve_app.domain.identifiers import is_client_id, is_proof_token, is_reference_id
from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState
from serve_app.pipelines.auth import ClientAuthenticator
from serve_app.pipelines.commands import AgeEstimationCommand, FaceSearchCommand
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.processing import public_result
from serve_app.pipelines.proofs import ProofService
from serve_app.pipelines.transactions import TransactionService
from serve_app.stores.interfaces import ClientInfo

CLIENT_SECRET_HEADER = "Client-Secret"
_JSON = "application/json"
_MULTIPART = "multipart/form-data"
_URLENCODED = "application/x-www-form-urlencoded"


@dataclass(frozen=True)
class ApiServices:
    transactions: TransactionService
    proofs: ProofService
    auth: ClientAuthenticator
    signer: TokenSigner
    max_upload_bytes: int
    wait_for_result_timeout_s: float
    public_base_url: str | None
    trusted_proxies: tuple[IPNetwork, ...] = ()  # whose X-Forwarded-For is believed
    gallery: GalleryService | None = None  # the gallery management extension (api/gallery.py)


def envelope(message: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"status": True, "message": message, "result": {"data": data}}


def create_app(services: ApiServices) -> FastAPI:
    app = FastAPI(
        title="Face search and age estimation",
        version="1.0.0",
        description=describe(),
        openapi_tags=[
            {"name": "auth"},
            {"name": "transactions"},
            {"name": "proofs"},
            {"name": "gallery (extension)"},
        ],
    )
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=services.max_upload_bytes + 64 * 1024)
    app.add_exception_handler(ServiceError, errors.service_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)
    mount_console(app, services.public_base_url)

    def source_of(request: Request) -> str:
        peer = request.client.host if request.client else None
        return client_source(peer, request.headers.getlist("x-forwarded-for"), services.trusted_proxies)

    async def tenant_of(request: Request) -> str:
        """Bearer access token, or the Client-Secret header; either way the client is the tenant. A failed
        check counts against the source's allowance of unauthenticated requests (429 once it is spent)."""
        try:
            client = await authenticated_client(request)
        except AuthenticationFailed:
            await services.auth.count_unauthenticated(source_of(request))
            raise
        await services.auth.count_request(client.client_id)
        return client.client_id

    async def authenticated_client(request: Request) -> ClientInfo:
        authorization = request.headers.get("authorization", "")
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthenticationFailed("Authorization must be 'Bearer <access token>'.")
            claims = services.signer.verify_access(token.strip())
            client = await services.auth.active_client(claims.client_id)
        elif secret := request.headers.get(CLIENT_SECRET_HEADER):
            client = await services.auth.client_by_secret(secret)
        else:
            raise AuthenticationFailed(
                f"Authentication required: send 'Authorization: Bearer <token>' or '{CLIENT_SECRET_HEADER}'."
            )
        return client

    def base_url(request: Request) -> str:
        return services.public_base_url or str(request.base_url).rstrip("/")

    @app.post(
        "/request-access-token",
        tags=["auth"],
        openapi_extra=REQUEST_BODIES["token"],
        responses=RESPONSES["token"],
    )
    async def request_access_token(request: Request) -> JSONResponse:
        source = source_of(request)
        await services.auth.count_unauthenticated(source)
        body = await parsing.read_body(request, (_JSON, _URLENCODED, _MULTIPART), 4096)
        client_id, client_secret = body.fields.get("client_id"), body.fields.get("client_secret")
        problems = {
            name: "required"
            for name, value in (("client_id", client_id), ("client_secret", client_secret))
            if not isinstance(value, str) or not value
        }
        if problems:
            raise ValidationFailed("client_id and client_secret are required.", problems)
        assert isinstance(client_id, str) and isinstance(client_secret, str)
        if not is_client_id(client_id):
            raise ValidationFailed(
                "client_id is not a valid client id.", {"client_id": "must be cl_ followed by 24 hex digits"}
            )
        client = await services.auth.login(client_id, client_secret, source)
        token, expires_in = services.signer.issue_access(client.client_id)
        data = {"token": token, "token_type": "Bearer", "expires_in": expires_in}
        return JSONResponse(envelope("Access token issued.", data))

    @app.post(
        "/face-search",
        tags=["transactions"],
        openapi_extra=REQUEST_BODIES["face_search"],
        responses=RESPONSES["create"],
    )
    async def face_search(request: Request) -> JSONResponse:
        tenant_id = await tenant_of(request)
        body = await parsing.read_body(request, (_JSON, _MULTIPART), services.max_upload_bytes)
        parsing.require_type(body, "face_search")
        allow_override = parsing.parse_flag(body, "allow_override", default=False)
        command = FaceSearchCommand(
            tenant_id=tenant_id,
            image=parsing.image_from_data_uri(body)
            if body.is_json
            else await parsing.image_from_upload(body, services.max_upload_bytes),
            client_reference=parsing.parse_client_reference(body, required=allow_override),
            allow_override=allow_override,
            enroll_face=parsing.parse_flag(body, "enroll_face", default=True),
        )
        tx = await services.transactions.create_face_search(command)
        return JSONResponse(envelope("Face search transaction created.", {"reference_id": tx.reference_id}))

    @app.post(
        "/age-estimation",
        tags=["transactions"],
        openapi_extra=REQUEST_BODIES["age"],
        responses=RESPONSES["age_create"],
    )
    async def age_estimation(request: Request) -> JSONResponse:
        tenant_id = await tenant_of(request)
        body = await parsing.read_body(request, (_MULTIPART,), services.max_upload_bytes)
        parsing.require_type(body, "age_estimation")
        enroll_face = parsing.parse_flag(body, "enroll_face", default=True)
        wait = parsing.parse_flag(body, "wait_for_result", default=False, allow_words=False)
        image = await parsing.image_from_upload(body, services.max_upload_bytes)
        tx = await services.transactions.create_age_estimation(
            AgeEstimationCommand(tenant_id=tenant_id, image=image, enroll_face=enroll_face)
        )
        if not wait:
            return JSONResponse(
                envelope("Age estimation transaction created.", {"reference_id": tx.reference_id})
            )
        final = await services.transactions.wait_final(tx, services.wait_for_result_timeout_s)
        return result_response(final, base_url(request), created=True)

    @app.post(
        "/result",
        tags=["transactions"],
        openapi_extra=REQUEST_BODIES["result"],
        responses=RESPONSES["result"],
    )
    async def result(request: Request) -> JSONResponse:
        tenant_id = await tenant_of(request)
        body = await parsing.read_body(request, (_JSON, _URLENCODED, _MULTIPART), 4096)
        reference_id = body.fields.get("reference_id")
        if reference_id is None or reference_id == "":
            raise ValidationFailed("reference_id is required.", {"reference_id": "required"})
        if not is_reference_id(reference_id):
            raise ValidationFailed(
                "reference_id is not a valid reference_id.",
                {"reference_id": "must be 32 lowercase hex digits"},
            )
        assert isinstance(reference_id, str)
        request.state.reference_id = reference_id  # for the log line of an error answer
        tx = await services.transactions.get_for_tenant(tenant_id, reference_id)
        # Long polling: one held request replaces the several polls a client would otherwise send.
        wait_s = parsing.preferred_wait_s(
            request.headers.getlist("prefer"), services.wait_for_result_timeout_s
        )
        if wait_s > 0 and not tx.state.is_final:
            tx = await services.transactions.wait_final(tx, wait_s)
        response = result_response(tx, base_url(request), created=False)
        if wait_s > 0:
            response.headers["Preference-Applied"] = f"wait={wait_s:g}"
        return response

    @app.get("/get-proof/{proof_token}", tags=["proofs"], responses=RESPONSES["proof"])
    async def get_proof(proof_token: str, request: Request) -> Response:
        try:
            if not is_proof_token(proof_token):
                # A URL that names no proof: 404 like any tampered token (the README's contract here).
                raise NotFound("No proof image exists for this URL.")
            claims = services.signer.verify_proof(proof_token)
            data, content_type = await services.proofs.load(claims.tenant_id, claims.face_id)
        except (NotFound, ProofExpired):
            # The URL is the credential here: a failed one counts like failed credentials elsewhere.
            await services.auth.count_unauthenticated(source_of(request))
            raise
        remaining = max(0, claims.expires_at - int(time.time()))
        return Response(
            data, media_type=content_type, headers={"Cache-Control": f"private, max-age={remaining}"}
        )

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, bool]:
        return {"status": True}

    def result_response(tx: Transaction, base: str, created: bool) -> JSONResponse:
        if not tx.state.is_final:
            message = (
                "Transaction created; the result was not ready in time. Poll /result with the reference_id."
                if created
                else "The transaction is still being processed; poll again."
            )
            data = {"reference_id": tx.reference_id, "state": tx.state.value}
            return JSONResponse(envelope(message, data), status_code=202, headers={"Retry-After": "1"})
        if tx.state is TransactionState.FAILED:
            body = errors.error_body(
                f"The transaction failed: {tx.error}", {"transaction": tx.error or "failed"}
            )
            body["result"] = {"data": {"reference_id": tx.reference_id, "state": tx.state.value}}
            return JSONResponse(body, status_code=200)
        return JSONResponse(envelope("Transaction result.", render_result(tx, base)))

    def render_result(tx: Transaction, base: str) -> dict[str, Any]:
        outcome = public_result(tx.result or {})
        if tx.kind is TransactionKind.AGE_ESTIMATION:
            return {"reference_id": tx.reference_id, **outcome}
        matched = [
            [
                face_id,
                score,
                f"{base}/get-proof/{services.signer.issue_proof(tx.tenant_id, face_id)}",
                reference,
            ]
            for face_id, score, reference in outcome.get("matched_faces", [])
        ]
        return {
            "service_reference_id": tx.reference_id,
            "client_reference": tx.client_reference or "",
            "face_search_response": {
                "result": {"matched_faces": matched, "is_face_found": bool(outcome.get("is_face_found"))}
            },
        }

    if services.gallery is not None:
        app.include_router(gallery_router(services.gallery, services.signer, tenant_of, base_url))
    return app

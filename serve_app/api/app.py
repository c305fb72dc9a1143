"""The REST interface (the vendor interface this service implements; the API guide is docs/api.md). Built per
replica by create_app()."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.api import errors
from serve_app.api.console import mount_console
from serve_app.api.dependencies import ApiServices as ApiServices  # re-exported: the app's one argument
from serve_app.api.json_response import JSONResponse
from serve_app.api.limits import BodySizeLimitMiddleware
from serve_app.api.routes import auth, gallery, proofs, transactions, webhooks
from serve_app.domain.errors import ServiceError

_DESCRIPTION = (
    "Face search (1:N) and age estimation. Create calls return a reference_id; POST /result returns the "
    "outcome. Authenticate with `Authorization: Bearer <token>` from /request-access-token, or with the "
    "`Client-Secret: <client secret>` header. Every error uses the envelope "
    '{"status": false, "message": ..., "errors": {...}}. A result that is not final yet answers 202 with '
    "`state` and a Retry-After header; send `Prefer: wait=<seconds>` to /result to have it wait for the "
    "final state instead (long polling), or to a create to have the create's own answer carry the result "
    "when it is final in time. The probe of a transaction is the largest face in the image."
)
# Room for the multipart framing and the other fields around the largest accepted image.
_BODY_OVERHEAD_BYTES = 64 * 1024


def create_app(services: ApiServices) -> FastAPI:
    app = FastAPI(
        title="Face search and age estimation",
        version="1.0.0",
        description=_DESCRIPTION,
        default_response_class=JSONResponse,
        openapi_tags=[
            {"name": "auth"},
            {"name": "transactions"},
            {"name": "proofs"},
            {"name": gallery.TAG},
            {"name": webhooks.TAG},
        ],
    )
    app.state.services = services  # read by serve_app.api.dependencies.api_services
    app.add_middleware(
        BodySizeLimitMiddleware, max_body_bytes=services.max_upload_bytes + _BODY_OVERHEAD_BYTES
    )
    app.add_exception_handler(ServiceError, errors.service_error_handler)
    app.add_exception_handler(RequestValidationError, errors.request_validation_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(Exception, errors.unexpected_error_handler)
    for module in (auth, transactions, proofs):
        app.include_router(module.router())
    if services.gallery is not None:
        app.include_router(gallery.router())
    if services.webhooks is not None:
        app.include_router(webhooks.router())
    mount_console(app, services.public_base_url)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, bool]:
        return {"status": True}

    return app

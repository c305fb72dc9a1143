"""The one mapping from errors to HTTP responses. Every failure uses the same envelope:
{"status": false, "message": "...", "errors": {"field": "problem", ...}}; clients never see a traceback.

Messages: a 4xx names the rule the request broke, in our own words. A failure behind the service (Redis,
Milvus, a model, a bug) gets its error class's fixed public_message, and its details (backend replies,
hosts, exception names) go to the log with the request and reference_id, never into a response."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import rule_error
from serve_app.domain import errors as domain

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: tuple[tuple[type[domain.ServiceError], int], ...] = (
    (domain.ValidationFailed, 422),
    (domain.UnsupportedMedia, 415),
    (domain.PayloadTooLarge, 413),
    (domain.AuthenticationFailed, 401),
    (domain.RateLimited, 429),
    (domain.NotFound, 404),
    (domain.ProofExpired, 410),
    (domain.StorageFull, 507),  # before its base class, BackendUnavailable
    (domain.BackendUnavailable, 503),
    (domain.ModelUnavailable, 503),
)


def error_body(message: str, errors: dict[str, str] | None = None) -> dict[str, Any]:
    return {"status": False, "message": message, "errors": errors or {}}


def status_for(error: domain.ServiceError) -> int:
    for error_type, status in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return status
    return 500


async def service_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, domain.ServiceError)
    status = status_for(exc)
    headers: dict[str, str] = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, domain.AuthenticationFailed):
        headers["WWW-Authenticate"] = 'Bearer realm="facesearch"'
    public = type(exc).public_message
    if public is not None or status >= 500:
        # The backend's own words go to the log only, with what identifies the request.
        logger.warning(
            "%s %s -> %d (reference_id %s): %s",
            request.method,
            request.url.path,
            status,
            getattr(request.state, "reference_id", "-"),
            exc.message,
        )
    if public is not None:
        return JSONResponse(error_body(public), status_code=status, headers=headers)
    return JSONResponse(error_body(exc.message, exc.details), status_code=status, headers=headers)


async def request_validation_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own parameter validation (query and path parameters) answers like every broken rule: a
    parameter typed with a rule() gets that rule's words, any other the ValidationFailed envelope and
    status, never FastAPI's default 422 body."""
    assert isinstance(exc, RequestValidationError)
    problems = exc.errors()
    failure = rule_error(problems[0]) if problems else None
    if failure is None:
        location = problems[0].get("loc", ()) if problems else ()
        name = str(location[-1]) if location else "request"
        failure = domain.ValidationFailed(f"The field '{name}' is invalid.", {name: "invalid"})
    return await service_error_handler(request, failure)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    messages = {404: "No such endpoint.", 405: "Method not allowed for this endpoint."}
    message = messages.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # Log the traceback for operators; the client gets a generic message only.
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body("Internal server error."), status_code=500)

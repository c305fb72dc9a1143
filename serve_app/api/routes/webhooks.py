"""The client's completion webhook (an extension beyond the vendor interface; docs/api.md, "Webhooks"): its
endpoint, its signing secret (shown once, when made), its delivery log and redelivery. Same
authentication, throttling and envelope as every other router."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, Field, StringConstraints
from pydantic.types import Strict

from serve_app.api import parsing
from serve_app.api.dependencies import ApiServices, Services, Tenant
from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import InterfaceBody, Problem, rule, validate_body
from serve_app.api.response_models import Envelope, envelope, error_responses, respond
from serve_app.api.routes.bodies import request_body
from serve_app.api.routes.gallery import PageSize, iso
from serve_app.domain.gallery import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from serve_app.domain.webhooks import MAX_URL_LENGTH, DeliveryAttempt, WebhookConfig
from serve_app.pipelines.webhooks import WebhookService

TAG = "webhooks (extension)"
_MAX_BODY_BYTES = 4096

WebhookUrlText = Annotated[
    str,
    rule(
        Annotated[str, Strict(), StringConstraints(min_length=1, max_length=MAX_URL_LENGTH)],
        Problem("url must be an https URL.", "must be an https URL"),
        field="url",
    ),
]
EventId = Annotated[
    str,
    rule(
        Annotated[str, StringConstraints(pattern=r"^evt_[0-9a-f]{32}$")],
        Problem("event_id is not a valid event id.", "must be evt_ followed by 32 hex digits"),
        field="event_id",
    ),
]


class WebhookRequest(InterfaceBody):
    url: WebhookUrlText = Field(description="https URL of the receiver (public addresses only)")


class WebhookData(BaseModel):
    url: str | None = Field(description="null: registered without an endpoint (nothing is sent)")
    created_at: str
    updated_at: str
    secret_rotated_at: str | None
    previous_secret_valid_until: str | None = Field(
        description="after a rotation, the old secret also signs until then (Standard Webhooks' several "
        "signatures)"
    )
    secret: str | None = Field(
        None,
        description="the signing secret (whsec_...): present only in the answer that made it, never again",
    )


class Delivery(BaseModel):
    event_id: str
    reference_id: str
    attempt: int
    at: str
    outcome: str = Field(description="delivered, retrying or dead")
    status_code: int | None = Field(description="the receiver's status; null when none came")
    error: str | None = Field(description="why no status came (a refusal, a timeout, a connection error)")
    duration_ms: float
    next_attempt_at: str | None


class DeliveryLog(BaseModel):
    deliveries: list[Delivery]


class Removed(BaseModel):
    deleted: bool = Field(description="false when no webhook was registered")


class Redelivery(BaseModel):
    event_id: str
    queued: bool = Field(description="false when the event was queued already")


def _data(config: WebhookConfig, secret: str | None = None) -> WebhookData:
    return WebhookData(
        url=config.url,
        created_at=iso(config.created_at),
        updated_at=iso(config.updated_at),
        secret_rotated_at=iso(config.secret_rotated_at) if config.secret_rotated_at is not None else None,
        previous_secret_valid_until=iso(config.previous_secret_until)
        if config.previous_secret_until is not None
        else None,
        secret=secret,
    )


def delivery(attempt: DeliveryAttempt) -> Delivery:
    return Delivery(
        event_id=attempt.event_id,
        reference_id=attempt.reference_id,
        attempt=attempt.attempt,
        at=iso(attempt.at),
        outcome=attempt.outcome,
        status_code=attempt.status_code,
        error=attempt.error,
        duration_ms=attempt.duration_ms,
        next_attempt_at=iso(attempt.next_attempt_at) if attempt.next_attempt_at is not None else None,
    )


def _webhooks(services: ApiServices) -> WebhookService:
    # create_app includes this router only when the replica has a webhook service.
    assert services.webhooks is not None
    return services.webhooks


def router() -> APIRouter:
    routes = APIRouter(tags=[TAG], responses=error_responses(401, 422, 429, 503))

    @routes.get(
        "/webhook",
        summary="The client's webhook endpoint (never its secret)",
        response_model=Envelope[WebhookData],
        responses={
            200: {"description": "The endpoint"},
            **error_responses(404, s404="No webhook registered"),
        },
    )
    async def get_webhook(tenant: Tenant, services: Services) -> JSONResponse:
        return respond(envelope("Webhook.", _data(await _webhooks(services).get(tenant))))

    @routes.put(
        "/webhook",
        summary="Register or change the endpoint; the first registration answers the signing secret once",
        openapi_extra=request_body({parsing.JSON: WebhookRequest}),
        response_model=Envelope[WebhookData],
        responses={200: {"description": "Registered"}, **error_responses(415)},
    )
    async def put_webhook(request: Request, tenant: Tenant, services: Services) -> JSONResponse:
        fields = await parsing.read_fields(request, (parsing.JSON,), _MAX_BODY_BYTES)
        body = validate_body(WebhookRequest, fields)
        registration = await _webhooks(services).register(tenant, body.url)
        return respond(envelope("Webhook registered.", _data(registration.config, registration.secret)))

    @routes.delete(
        "/webhook",
        summary="Remove the endpoint, its secrets and its delivery log; nothing more is sent",
        response_model=Envelope[Removed],
        responses={200: {"description": "Removed"}},
    )
    async def delete_webhook(tenant: Tenant, services: Services) -> JSONResponse:
        deleted = await _webhooks(services).remove(tenant)
        return respond(envelope("Webhook removed.", Removed(deleted=deleted)))

    @routes.post(
        "/webhook/secret",
        summary="Rotate the signing secret; answers the new one once (the old one also signs for a while)",
        response_model=Envelope[WebhookData],
        responses={200: {"description": "Rotated"}, **error_responses(404, s404="No webhook registered")},
    )
    async def rotate_secret(tenant: Tenant, services: Services) -> JSONResponse:
        registration = await _webhooks(services).rotate_secret(tenant)
        return respond(envelope("Webhook secret rotated.", _data(registration.config, registration.secret)))

    @routes.get(
        "/webhook/deliveries",
        summary="The client's last delivery attempts, newest first",
        response_model=Envelope[DeliveryLog],
        responses={200: {"description": "The delivery log"}},
    )
    async def deliveries(
        tenant: Tenant,
        services: Services,
        limit: Annotated[
            PageSize,
            Query(description=f"how many, 1 to {MAX_PAGE_SIZE} (the log keeps FACESEARCH_WEBHOOK_LOG_SIZE)"),
        ] = DEFAULT_PAGE_SIZE,
    ) -> JSONResponse:
        log = await _webhooks(services).deliveries(tenant, limit)
        return respond(envelope("Webhook deliveries.", DeliveryLog(deliveries=[delivery(a) for a in log])))

    @routes.post(
        "/webhook/events/{event_id}/redeliver",
        summary="Send a delivered or dead event again (a fresh retry window)",
        response_model=Envelope[Redelivery],
        responses={
            200: {"description": "Queued"},
            **error_responses(404, s404="No such event (kept 7 days)"),
        },
    )
    async def redeliver(
        tenant: Tenant,
        services: Services,
        event_id: Annotated[EventId, Path(description="evt_ and 32 hex digits, from the delivery log")],
    ) -> JSONResponse:
        queued = await _webhooks(services).redeliver(tenant, event_id)
        return respond(envelope("Event queued for delivery.", Redelivery(event_id=event_id, queued=queued)))

    return routes

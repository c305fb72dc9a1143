"""Gallery management endpoints (an extension beyond the vendor interface; the contract is in
docs/gallery.md, "Gallery management (extension)"). Same authentication, throttling and envelope as the
interface's endpoints: the routes declare the Tenant and Services dependencies like every other router.

Query and path values are typed with the rules of serve_app.api.request_models, so a bad one gets the
service's one error envelope (422) with the rule's own words, never FastAPI's own body.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, Field, StringConstraints
from pydantic.types import Strict

from serve_app.api import parsing
from serve_app.api.dependencies import ApiServices, Services, Tenant, base_url
from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import (
    CLIENT_REFERENCE_PROBLEMS,
    CONTROL_CHARACTERS,
    ClientReference,
    ClientReferenceText,
    InterfaceBody,
    Problem,
    rule,
    validate_body,
)
from serve_app.api.response_models import Envelope, envelope, error_responses, respond
from serve_app.api.routes.bodies import request_body
from serve_app.domain.gallery import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from serve_app.domain.identifiers import FACE_ID_PATTERN
from serve_app.pipelines.gallery import GalleryService

TAG = "gallery (extension)"
# Small bodies only: one client_reference.
_MAX_BODY_BYTES = 4096


class GalleryFace(BaseModel):
    face_id: str = Field(description="f and 32 hex digits")
    client_reference: str = Field(description='"" when the face was enrolled without one')
    enrolled_at: str = Field(description="ISO-8601 UTC, e.g. 2026-11-23T18:52:07Z")
    model_version: str
    proof_url: str = Field(description="a fresh /get-proof URL, valid for the proof lifetime (15 minutes)")


class FacePage(BaseModel):
    faces: list[GalleryFace]
    next_cursor: str | None = Field(description="pass as cursor for the next page; null at the end")


class DeletedFace(BaseModel):
    face_id: str
    deleted: Literal[True] = True


class ErasureRequest(InterfaceBody):
    client_reference: ClientReference


class ErasureResult(BaseModel):
    client_reference: str
    faces_erased: int
    erased_at: str


class GalleryStatsData(BaseModel):
    faces: int
    client_references: int
    model_version: str
    oldest_enrolment: str | None
    newest_enrolment: str | None


class AuditItem(BaseModel):
    at: str
    actor: str = Field(description="the client id that asked")
    action: Literal["erase_reference", "delete_face"]
    faces: int
    subject: str = Field(description="keyed hash (HMAC-SHA256) of the client_reference or face id")


class AuditPageData(BaseModel):
    entries: list[AuditItem]
    next_cursor: str | None


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _query_integer(value: object) -> object:
    """Query text in the canonical form of an integer (no sign, leading zero or blanks) as that integer."""
    if isinstance(value, str) and re.fullmatch(r"[1-9][0-9]{0,5}", value):
        return int(value)
    return value


# An empty query value is an absent one: the default applies.
PageSize = Annotated[
    int,
    rule(
        Annotated[int, Strict(), Field(ge=1, le=MAX_PAGE_SIZE)] | Literal[""],
        Problem(f"limit must be between 1 and {MAX_PAGE_SIZE}.", f"must be 1 to {MAX_PAGE_SIZE}"),
        field="limit",
        parse=_query_integer,
        convert=lambda value, _: value or DEFAULT_PAGE_SIZE,
    ),
]
ReferenceFilter = Annotated[
    str | None,
    rule(
        ClientReferenceText | Literal[""],
        CONTROL_CHARACTERS,
        CLIENT_REFERENCE_PROBLEMS,
        field="client_reference",
        convert=lambda value, _: value or None,
    ),
]
FaceId = Annotated[
    str,
    rule(
        Annotated[str, StringConstraints(pattern=FACE_ID_PATTERN)],
        Problem("face_id is not a valid face id.", "must be f followed by 32 hex digits"),
        field="face_id",
    ),
]
_LIMIT = Query(description=f"page size, 1 to {MAX_PAGE_SIZE}")
_CURSOR = Query(description="next_cursor of the previous page")


def _gallery(services: ApiServices) -> GalleryService:
    # create_app includes this router only when the replica has a gallery service.
    assert services.gallery is not None
    return services.gallery


def router() -> APIRouter:
    routes = APIRouter(tags=[TAG], responses=error_responses(401, 422, 429, 503))

    @routes.get(
        "/gallery/faces",
        summary="List the tenant's enrolled faces",
        response_model=Envelope[FacePage],
        responses={200: {"description": "One page of enrolled faces"}},
    )
    async def list_faces(
        request: Request,
        tenant_id: Tenant,
        services: Services,
        client_reference: Annotated[
            ReferenceFilter, Query(description="only the faces of this client_reference")
        ] = None,
        limit: Annotated[PageSize, _LIMIT] = DEFAULT_PAGE_SIZE,
        cursor: Annotated[str | None, _CURSOR] = None,
    ) -> JSONResponse:
        page = await _gallery(services).list_faces(tenant_id, client_reference, cursor, limit)
        base = base_url(request, services)
        faces = [
            GalleryFace(
                face_id=record.face_id,
                client_reference=record.client_reference or "",
                enrolled_at=iso(record.created_at),
                model_version=record.model_version,
                proof_url=f"{base}/get-proof/{services.signer.issue_proof(tenant_id, record.face_id)}",
            )
            for record in page.faces
        ]
        return respond(envelope("Enrolled faces.", FacePage(faces=faces, next_cursor=page.next_cursor)))

    @routes.delete(
        "/gallery/faces/{face_id}",
        summary="Delete one enrolled face (vector, record and proof image)",
        response_model=Envelope[DeletedFace],
        responses={
            200: {"description": "The face is gone"},
            **error_responses(404, s404="No such face in this tenant's gallery"),
        },
    )
    async def delete_face(
        tenant_id: Tenant,
        services: Services,
        face_id: Annotated[FaceId, Path(description="f and 32 lowercase hex digits")],
    ) -> JSONResponse:
        await _gallery(services).delete_face(tenant_id, tenant_id, face_id)
        return respond(envelope("Face deleted.", DeletedFace(face_id=face_id)))

    @routes.post(
        "/gallery/erasures",
        summary="Erase every face of a client_reference (idempotent)",
        openapi_extra=request_body({parsing.JSON: ErasureRequest}),
        response_model=Envelope[ErasureResult],
        responses={200: {"description": "How many faces were erased (0 or more)"}, **error_responses(415)},
    )
    async def erase(request: Request, tenant_id: Tenant, services: Services) -> JSONResponse:
        fields = await parsing.read_fields(request, (parsing.JSON,), _MAX_BODY_BYTES)
        reference = validate_body(ErasureRequest, fields).client_reference
        assert reference is not None  # required by the model
        erasure = await _gallery(services).erase_reference(tenant_id, tenant_id, reference)
        data = ErasureResult(
            client_reference=erasure.client_reference,
            faces_erased=erasure.faces_erased,
            erased_at=iso(erasure.erased_at),
        )
        return respond(envelope("Client reference erased.", data))

    @routes.get(
        "/gallery/stats",
        summary="Gallery statistics of the tenant",
        response_model=Envelope[GalleryStatsData],
        responses={200: {"description": "Counts and dates"}},
    )
    async def stats(tenant_id: Tenant, services: Services) -> JSONResponse:
        result = await _gallery(services).stats(tenant_id)
        counts = result.counts
        data = GalleryStatsData(
            faces=counts.faces,
            client_references=counts.client_references,
            model_version=result.model_version,
            oldest_enrolment=iso(counts.oldest_enrolment) if counts.oldest_enrolment is not None else None,
            newest_enrolment=iso(counts.newest_enrolment) if counts.newest_enrolment is not None else None,
        )
        return respond(envelope("Gallery statistics.", data))

    @routes.get(
        "/gallery/audit",
        summary="The tenant's audit trail of deletions and erasures, newest first",
        response_model=Envelope[AuditPageData],
        responses={200: {"description": "One page of audit entries"}},
    )
    async def audit(
        tenant_id: Tenant,
        services: Services,
        limit: Annotated[PageSize, _LIMIT] = DEFAULT_PAGE_SIZE,
        cursor: Annotated[str | None, _CURSOR] = None,
    ) -> JSONResponse:
        page = await _gallery(services).audit(tenant_id, cursor, limit)
        entries = [
            AuditItem(
                at=iso(entry.at),
                actor=entry.actor,
                action=entry.action.value,
                faces=entry.faces,
                subject=entry.subject,
            )
            for entry in page.entries
        ]
        return respond(envelope("Audit trail.", AuditPageData(entries=entries, next_cursor=page.next_cursor)))

    return routes

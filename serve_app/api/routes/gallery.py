"""Gallery management endpoints (an extension beyond the vendor interface; the contract is in
docs/gallery.md, "Gallery management (extension)"). Same authentication, throttling and envelope as the
interface's endpoints: the routes declare the Tenant and Services dependencies like every other router.

Query values are read as strings and checked here, so a bad one gets the service's one error envelope (422)
like every other invalid field, never FastAPI's own body.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, Field

from serve_app.api import parsing
from serve_app.api.dependencies import ApiServices, Services, Tenant, base_url
from serve_app.api.json_response import JSONResponse
from serve_app.api.request_models import ClientReference, InterfaceBody, validate_body
from serve_app.api.response_models import Envelope, error_responses
from serve_app.api.routes.bodies import envelope, request_body
from serve_app.domain.errors import ValidationFailed
from serve_app.domain.identifiers import FACE_ID_PATTERN
from serve_app.pipelines.gallery import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, GalleryService

TAG = "gallery (extension)"
_LIMIT_PATTERN = f"^([1-9]|[1-9][0-9]|1[0-9][0-9]|{MAX_PAGE_SIZE})?$"
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


class FaceFilter(InterfaceBody):
    client_reference: ClientReference = None


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


_ERRORS: dict[int | str, dict[str, Any]] = error_responses(401, 422, 429, 503)


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return DEFAULT_PAGE_SIZE
    # The syntax only (no sign, leading zero or spaces); the range is the pipeline's rule.
    if re.fullmatch(r"[1-9][0-9]{0,5}", raw) is None:
        raise ValidationFailed(
            f"limit must be between 1 and {MAX_PAGE_SIZE}.", {"limit": f"must be 1 to {MAX_PAGE_SIZE}"}
        )
    return int(raw)


def _gallery(services: ApiServices) -> GalleryService:
    # create_app includes this router only when the replica has a gallery service.
    assert services.gallery is not None
    return services.gallery


def router() -> APIRouter:
    routes = APIRouter(tags=[TAG], responses=_ERRORS)
    # The rules are stated in the schema (json_schema_extra) but checked by the handlers, so a value that
    # breaks them gets the service's envelope rather than FastAPI's own 422 body.
    limit_query = Query(
        None,
        description=f"page size, 1 to {MAX_PAGE_SIZE} (default {DEFAULT_PAGE_SIZE})",
        json_schema_extra={"pattern": _LIMIT_PATTERN},
    )
    cursor_query = Query(None, description="next_cursor of the previous page")

    @routes.get(
        "/gallery/faces",
        summary="List the tenant's enrolled faces",
        responses={200: {"model": Envelope[FacePage], "description": "One page of enrolled faces"}},
    )
    async def list_faces(
        request: Request,
        tenant_id: Tenant,
        services: Services,
        client_reference: str | None = Query(
            None,
            description="only the faces of this client_reference",
            json_schema_extra={"maxLength": 255, "pattern": "^([^\\x00-\\x1f]{5,})?$"},
        ),
        limit: str | None = limit_query,
        cursor: str | None = cursor_query,
    ) -> JSONResponse:
        wanted = validate_body(FaceFilter, {"client_reference": client_reference}).client_reference
        page = await _gallery(services).list_faces(tenant_id, wanted, cursor, _limit(limit))
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
        data = FacePage(faces=faces, next_cursor=page.next_cursor)
        return JSONResponse(envelope("Enrolled faces.", data.model_dump()))

    @routes.delete(
        "/gallery/faces/{face_id}",
        summary="Delete one enrolled face (vector, record and proof image)",
        responses={
            200: {"model": Envelope[DeletedFace], "description": "The face is gone"},
            **error_responses(404, s404="No such face in this tenant's gallery"),
        },
    )
    async def delete_face(
        tenant_id: Tenant,
        services: Services,
        face_id: str = Path(
            description="f and 32 lowercase hex digits", json_schema_extra={"pattern": FACE_ID_PATTERN}
        ),
    ) -> JSONResponse:
        await _gallery(services).delete_face(tenant_id, tenant_id, face_id)
        return JSONResponse(envelope("Face deleted.", DeletedFace(face_id=face_id).model_dump()))

    @routes.post(
        "/gallery/erasures",
        summary="Erase every face of a client_reference (idempotent)",
        openapi_extra=request_body({parsing.JSON: ErasureRequest}),
        responses={
            200: {"model": Envelope[ErasureResult], "description": "How many faces were erased (0 or more)"},
            **error_responses(415),
        },
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
        return JSONResponse(envelope("Client reference erased.", data.model_dump()))

    @routes.get(
        "/gallery/stats",
        summary="Gallery statistics of the tenant",
        responses={200: {"model": Envelope[GalleryStatsData], "description": "Counts and dates"}},
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
        return JSONResponse(envelope("Gallery statistics.", data.model_dump()))

    @routes.get(
        "/gallery/audit",
        summary="The tenant's audit trail of deletions and erasures, newest first",
        responses={200: {"model": Envelope[AuditPageData], "description": "One page of audit entries"}},
    )
    async def audit(
        tenant_id: Tenant,
        services: Services,
        limit: str | None = limit_query,
        cursor: str | None = cursor_query,
    ) -> JSONResponse:
        page = await _gallery(services).audit(tenant_id, cursor, _limit(limit))
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
        data = AuditPageData(entries=entries, next_cursor=page.next_cursor)
        return JSONResponse(envelope("Audit trail.", data.model_dump()))

    return routes

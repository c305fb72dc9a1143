"""Gallery management endpoints (an extension beyond the vendor interface; the contract is in the
README, "Gallery management (extension)"). Same authentication and envelope as the interface's endpoints.

gallery_router() builds the routes from what they need, so the app that includes them decides how a tenant
is resolved. Query values are read as strings and checked here, so a bad one gets the service's one error
envelope (422) like every other invalid field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Generic, Literal, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from serve_app.api import parsing
from serve_app.api.tokens import TokenSigner
from serve_app.domain.errors import ValidationFailed
from serve_app.pipelines.gallery import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, GalleryService

TAG = "gallery (extension)"
T = TypeVar("T")


class Data(BaseModel, Generic[T]):
    data: T


class Envelope(BaseModel, Generic[T]):
    status: Literal[True] = True
    message: str
    result: Data[T]


class ErrorEnvelope(BaseModel):
    status: Literal[False] = False
    message: str
    errors: dict[str, str] = Field(description="field -> problem")


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


class ErasureRequest(BaseModel):
    client_reference: str = Field(
        min_length=5, max_length=255, pattern="^[^\\x00-\\x1f]*$", description="as the interface's"
    )


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


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorEnvelope, "description": description}
    for status, description in (
        (401, "missing, invalid or revoked credentials"),
        (422, "an invalid field (limit, cursor, face_id, client_reference)"),
        (429, "rate limited (Retry-After)"),
        (503, "Redis or Milvus unavailable (Retry-After)"),
    )
}


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return DEFAULT_PAGE_SIZE
    if not raw.isascii() or not raw.isdigit() or len(raw) > 6:
        raise ValidationFailed(
            f"limit must be between 1 and {MAX_PAGE_SIZE}.", {"limit": f"must be 1 to {MAX_PAGE_SIZE}"}
        )
    return int(raw)


def _reference(raw: object, required: bool) -> str | None:
    if raw is None or raw == "":
        if required:
            raise ValidationFailed("client_reference is required.", {"client_reference": "required"})
        return None
    body = parsing.Body(fields={"client_reference": raw}, files={}, is_json=True)
    return parsing.parse_client_reference(body, required=required)


def _ok(message: str, data: T) -> Envelope[T]:
    return Envelope[T](message=message, result=Data[T](data=data))


def gallery_router(
    service: GalleryService,
    signer: TokenSigner,
    tenant: Callable[[Request], Awaitable[str]],
    base_url: Callable[[Request], str],
) -> APIRouter:
    """tenant: resolves (and rate-limits) the authenticated client of a request, raising
    AuthenticationFailed; base_url: the base of proof URLs for a request."""
    router = APIRouter(tags=[TAG], responses=_ERRORS)
    limit_query = Query(None, description=f"page size, 1 to {MAX_PAGE_SIZE} (default {DEFAULT_PAGE_SIZE})")
    cursor_query = Query(None, description="next_cursor of the previous page")

    @router.get(
        "/gallery/faces",
        summary="List the tenant's enrolled faces",
        response_model=Envelope[FacePage],
    )
    async def list_faces(
        request: Request,
        tenant_id: str = Depends(tenant),
        client_reference: str | None = Query(None, description="only the faces of this client_reference"),
        limit: str | None = limit_query,
        cursor: str | None = cursor_query,
    ) -> Envelope[FacePage]:
        page = await service.list_faces(
            tenant_id, _reference(client_reference, required=False), cursor, _limit(limit)
        )
        base = base_url(request)
        faces = [
            GalleryFace(
                face_id=record.face_id,
                client_reference=record.client_reference or "",
                enrolled_at=iso(record.created_at),
                model_version=record.model_version,
                proof_url=f"{base}/get-proof/{signer.issue_proof(tenant_id, record.face_id)}",
            )
            for record in page.faces
        ]
        return _ok("Enrolled faces.", FacePage(faces=faces, next_cursor=page.next_cursor))

    @router.delete(
        "/gallery/faces/{face_id}",
        summary="Delete one enrolled face (vector, record and proof image)",
        response_model=Envelope[DeletedFace],
        responses={404: {"model": ErrorEnvelope, "description": "no such face in this tenant's gallery"}},
    )
    async def delete_face(face_id: str, tenant_id: str = Depends(tenant)) -> Envelope[DeletedFace]:
        await service.delete_face(tenant_id, tenant_id, face_id)
        return _ok("Face deleted.", DeletedFace(face_id=face_id))

    @router.post(
        "/gallery/erasures",
        summary="Erase every face of a client_reference (idempotent)",
        response_model=Envelope[ErasureResult],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ErasureRequest.model_json_schema()}},
            }
        },
        responses={415: {"model": ErrorEnvelope, "description": "not a JSON body"}},
    )
    async def erase(request: Request, tenant_id: str = Depends(tenant)) -> Envelope[ErasureResult]:
        body = await parsing.read_body(request, ("application/json",), 4096)
        reference = _reference(body.fields.get("client_reference"), required=True)
        assert reference is not None
        erasure = await service.erase_reference(tenant_id, tenant_id, reference)
        data = ErasureResult(
            client_reference=erasure.client_reference,
            faces_erased=erasure.faces_erased,
            erased_at=iso(erasure.erased_at),
        )
        return _ok("Client reference erased.", data)

    @router.get(
        "/gallery/stats",
        summary="Gallery statistics of the tenant",
        response_model=Envelope[GalleryStatsData],
    )
    async def stats(tenant_id: str = Depends(tenant)) -> Envelope[GalleryStatsData]:
        result = await service.stats(tenant_id)
        counts = result.counts
        data = GalleryStatsData(
            faces=counts.faces,
            client_references=counts.client_references,
            model_version=result.model_version,
            oldest_enrolment=iso(counts.oldest_enrolment) if counts.oldest_enrolment is not None else None,
            newest_enrolment=iso(counts.newest_enrolment) if counts.newest_enrolment is not None else None,
        )
        return _ok("Gallery statistics.", data)

    @router.get(
        "/gallery/audit",
        summary="The tenant's audit trail of deletions and erasures, newest first",
        response_model=Envelope[AuditPageData],
    )
    async def audit(
        tenant_id: str = Depends(tenant),
        limit: str | None = limit_query,
        cursor: str | None = cursor_query,
    ) -> Envelope[AuditPageData]:
        page = await service.audit(tenant_id, cursor, _limit(limit))
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
        return _ok("Audit trail.", AuditPageData(entries=entries, next_cursor=page.next_cursor))

    return router

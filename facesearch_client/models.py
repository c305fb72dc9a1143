"""Typed results of the facesearch API (the interface's and the gallery extension's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Match:
    face_id: str
    score: float
    proof_url: str
    client_reference: str  # "" when the enrolled face had none


@dataclass(frozen=True)
class FaceSearchResult:
    reference_id: str
    client_reference: str
    is_face_found: bool
    matches: list[Match]
    raw: dict[str, Any] = field(repr=False, compare=False)  # result.data as the service sent it


@dataclass(frozen=True)
class AgeResult:
    reference_id: str
    age: int | None
    under_18: int | None
    under_21: int | None
    raw: dict[str, Any] = field(repr=False, compare=False)


@dataclass(frozen=True)
class Pending:
    """Not final yet (HTTP 202): poll again."""

    reference_id: str
    state: str  # queued | processing


@dataclass(frozen=True)
class GalleryFace:
    face_id: str
    client_reference: str
    enrolled_at: str
    model_version: str
    proof_url: str


@dataclass(frozen=True)
class GalleryPage:
    faces: list[GalleryFace]
    next_cursor: str | None


@dataclass(frozen=True)
class Erasure:
    client_reference: str
    faces_erased: int
    erased_at: str


@dataclass(frozen=True)
class GalleryStats:
    faces: int
    client_references: int
    model_version: str
    oldest_enrolment: str | None
    newest_enrolment: str | None


@dataclass(frozen=True)
class AuditEntry:
    at: str
    actor: str
    action: str
    faces: int
    subject: str


@dataclass(frozen=True)
class AuditPage:
    entries: list[AuditEntry]
    next_cursor: str | None


Result = FaceSearchResult | AgeResult


def parse_result(data: dict[str, Any]) -> Result:
    """result.data of a final /result (or wait_for_result) answer."""
    if "face_search_response" in data:
        inner = data["face_search_response"]["result"]
        return FaceSearchResult(
            reference_id=str(data["service_reference_id"]),
            client_reference=str(data.get("client_reference", "")),
            is_face_found=bool(inner["is_face_found"]),
            matches=[Match(str(m[0]), float(m[1]), str(m[2]), str(m[3])) for m in inner["matched_faces"]],
            raw=data,
        )
    return AgeResult(
        reference_id=str(data["reference_id"]),
        age=data.get("age"),
        under_18=data.get("under_18"),
        under_21=data.get("under_21"),
        raw=data,
    )


def parse_gallery_page(data: dict[str, Any]) -> GalleryPage:
    return GalleryPage([GalleryFace(**face) for face in data["faces"]], data.get("next_cursor"))


def parse_audit_page(data: dict[str, Any]) -> AuditPage:
    return AuditPage([AuditEntry(**entry) for entry in data["entries"]], data.get("next_cursor"))

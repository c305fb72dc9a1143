"""Validated requests, as the API hands them to the pipelines."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaceSearchCommand:
    tenant_id: str
    image: bytes
    client_reference: str | None
    allow_override: bool
    enroll_face: bool


@dataclass(frozen=True)
class AgeEstimationCommand:
    tenant_id: str
    image: bytes
    enroll_face: bool

"""The OpenAPI requestBody of a route that reads its body itself (one route takes JSON or multipart, which a
FastAPI body parameter cannot)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def request_body(models: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """openapi_extra for a route whose body validates into these models, one per accepted media type; the
    schemas are the models' own (FastAPI's documented form for bodies a route parses itself)."""
    return {
        "requestBody": {
            "required": True,
            "content": {media: {"schema": model.model_json_schema()} for media, model in models.items()},
        }
    }

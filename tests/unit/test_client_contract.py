"""The Python client's result types (facesearch_client/models.py) against the server's own OpenAPI document:
each field exists in the schema of the response the client parses, with the same JSON type and the same
required-ness, and every field the schema requires is read by the client. A field renamed on either side
fails here, not in a user's program."""

from __future__ import annotations

import asyncio
import dataclasses
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest

import facesearch_client.models as client
from serve_app.api.app import create_app
from serve_app.domain.gallery import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from serve_app.pipelines.webhooks import WebhookPolicy, WebhookService
from tests.unit.fakes import FakeWebhookStore, World, build_api
from tests.unit.test_gallery import _with_gallery, service

Schema = dict[str, Any]
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


@dataclasses.dataclass(frozen=True)
class Parsed:
    """Where a client type is read from: result.data of one answer (a branch of a union of data models is
    picked by model name), and the wire name of each client field where it differs ("a.b" for nested)."""

    path: str
    method: str
    status: str
    model: type[Any]
    data_branch: str | None = None
    wire: dict[str, str] = dataclasses.field(default_factory=dict)


PARSED = [
    Parsed(
        "/result",
        "post",
        "200",
        client.FaceSearchResult,
        "FaceSearchData",
        {
            "reference_id": "service_reference_id",
            "is_face_found": "face_search_response.result.is_face_found",
            "matches": "face_search_response.result.matched_faces",
        },
    ),
    Parsed("/result", "post", "200", client.AgeResult, "AgeData"),
    Parsed("/age-estimation", "post", "200", client.AgeResult, "AgeData"),
    Parsed("/result", "post", "202", client.Pending),
    Parsed("/gallery/faces", "get", "200", client.GalleryPage),
    Parsed("/gallery/erasures", "post", "200", client.Erasure),
    Parsed("/gallery/stats", "get", "200", client.GalleryStats),
    Parsed("/gallery/audit", "get", "200", client.AuditPage),
]
# A match is a quadruple on the wire: the client's fields in order.
MATCH_POSITIONS = ("face_id", "score", "proof_url", "client_reference")
NOT_ON_THE_WIRE = {"raw"}  # the client's copy of result.data as received


@pytest.fixture(scope="module")
def document() -> Schema:
    async def build() -> Schema:
        world = World()
        api = await build_api(world)
        services = _with_gallery(api.services, service(world))
        # The webhook routes too (their delivery log pages by the same rule), on the fake store.
        webhooks = WebhookService(FakeWebhookStore(), WebhookPolicy(), unresolved)
        return create_app(dataclasses.replace(services, webhooks=webhooks)).openapi()

    return asyncio.run(build())


async def unresolved(host: str, port: int) -> list[str]:
    return []


def resolve(document: Schema, schema: Schema) -> Schema:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def json_types(document: Schema, schema: Schema) -> set[str]:
    schema = resolve(document, schema)
    if "anyOf" in schema:
        return set().union(*(json_types(document, option) for option in schema["anyOf"]))
    return {schema["type"]}


def python_types(annotation: Any) -> set[str]:
    if get_origin(annotation) in (Union, types.UnionType):
        return set().union(*(python_types(option) for option in get_args(annotation)))
    if get_origin(annotation) is list:
        return {"array"}
    return {_JSON_TYPES[annotation]}


def data_schema(document: Schema, parsed: Parsed) -> Schema:
    operation = document["paths"][parsed.path][parsed.method]
    body = resolve(document, operation["responses"][parsed.status]["content"]["application/json"]["schema"])
    envelope = next(
        resolve(document, option)
        for option in body.get("anyOf", [body])
        if resolve(document, option)["properties"]["status"].get("const") is True
    )
    data = resolve(document, resolve(document, envelope["properties"]["result"])["properties"]["data"])
    if parsed.data_branch is None:
        return data
    return next(
        resolve(document, option)
        for option in data["anyOf"]
        if option["$ref"].rsplit("/", 1)[-1] == parsed.data_branch
    )


def field_schema(document: Schema, parent: Schema, wire: str) -> tuple[Schema, bool]:
    """The schema of a (dotted) wire field and whether it is required at every level."""
    required = True
    schema = parent
    for name in wire.split("."):
        if name not in schema.get("properties", {}):
            raise LookupError(f"{name!r} is not a field of {schema.get('title')}")
        required = required and name in schema.get("required", [])
        schema = resolve(document, schema["properties"][name])
    return schema, required


def check_type(document: Schema, model: type[Any], data: Schema, wire: dict[str, str]) -> list[str]:
    problems: list[str] = []
    hints = get_type_hints(model)
    read: set[str] = set()
    for field in dataclasses.fields(model):
        if field.name in NOT_ON_THE_WIRE:
            continue
        name = wire.get(field.name, field.name)
        read.add(name.split(".")[0])
        try:
            schema, required = field_schema(document, data, name)
        except LookupError as missing:
            problems.append(f"{model.__name__}.{field.name}: {missing}")
            continue
        expected, actual = python_types(hints[field.name]), json_types(document, schema)
        if expected != actual:
            problems.append(f"{model.__name__}.{field.name}: client {expected}, service {actual}")
        if "null" not in expected and not required:
            problems.append(f"{model.__name__}.{field.name}: the client needs it, the service may omit it")
        item = get_args(hints[field.name])[0] if get_origin(hints[field.name]) is list else None
        items = resolve(document, schema.get("items", {}))
        # A list of objects is checked like its client type; a match (a quadruple) has its own test.
        if isinstance(item, type) and dataclasses.is_dataclass(item) and items.get("type") == "object":
            problems += check_type(document, item, items, {})
    unread = set(data.get("required", [])) - read
    if unread:
        problems.append(f"{model.__name__}: the service's required {sorted(unread)} are not read")
    return problems


@pytest.mark.parametrize("parsed", PARSED, ids=[f"{p.model.__name__}-{p.path}-{p.status}" for p in PARSED])
def test_client_result_types_match_the_openapi_document(document: Schema, parsed: Parsed) -> None:
    assert check_type(document, parsed.model, data_schema(document, parsed), parsed.wire) == []


def test_a_match_is_the_documented_quadruple(document: Schema) -> None:
    data = data_schema(document, PARSED[0])
    matches, _ = field_schema(document, data, PARSED[0].wire["matches"])
    positions = matches["items"]["prefixItems"]
    hints = get_type_hints(client.Match)
    assert [field.name for field in dataclasses.fields(client.Match)] == list(MATCH_POSITIONS)
    assert len(positions) == len(MATCH_POSITIONS) and matches["items"].get("maxItems") == len(positions)
    for name, schema in zip(MATCH_POSITIONS, positions, strict=True):
        assert python_types(hints[name]) == json_types(document, schema), name


def test_the_page_size_rule_is_the_documented_one(document: Schema) -> None:
    """The schema of `limit` is generated from the service's constants, and the client pages with its
    maximum."""
    for path in ("/gallery/faces", "/gallery/audit", "/webhook/deliveries"):
        parameters = document["paths"][path]["get"]["parameters"]
        limit = next(parameter for parameter in parameters if parameter["name"] == "limit")["schema"]
        assert limit["default"] == DEFAULT_PAGE_SIZE
        integer = next(option for option in limit["anyOf"] if option.get("type") == "integer")
        assert (integer["minimum"], integer["maximum"]) == (1, MAX_PAGE_SIZE)
        assert client_page_size() == integer["maximum"]


def client_page_size() -> int:
    from inspect import signature

    from facesearch_client import AsyncFaceSearchClient, FaceSearchClient

    sizes = {
        signature(kind.iter_faces).parameters["page_size"].default
        for kind in (FaceSearchClient, AsyncFaceSearchClient)
    }
    assert len(sizes) == 1
    size = sizes.pop()
    assert isinstance(size, int)
    return size

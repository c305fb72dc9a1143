"""Hostile and malformed requests: each gets one clean 4xx in the common error envelope, never a 5xx or a
hang. The inputs that must work (unusual but valid images) are checked at the end."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from PIL import Image
from starlette.types import Message, Scope

from serve_app.api.app import create_app
from serve_app.domain.transactions import TransactionState
from tests.unit.fakes import Api, assert_error_envelope, build_api, image_bytes, uniform_png

MAX_UPLOAD = 256 * 1024  # the middleware allows this plus 64 KiB for the rest of the form
MIDDLEWARE_LIMIT = MAX_UPLOAD + 64 * 1024


# ------------------------------------------------------------------------------------------ images


@functools.cache
def noise(size: tuple[int, int] = (64, 48)) -> Image.Image:
    pixels = np.random.default_rng(7).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@functools.cache
def png() -> bytes:
    return image_bytes(noise(), "PNG")


@functools.cache
def jpg() -> bytes:
    return image_bytes(noise(), "JPEG", quality=90)


@functools.cache
def huge_bilevel_png() -> bytes:
    """20000x20000 (400 MP) 1-bit PNG: about 50 KB on disk; beyond even Pillow's own bomb limit."""
    return uniform_png(20_000, 20_000, bit_depth=1, color_type=0)


@functools.cache
def large_palette_png() -> bytes:
    """8000x8000 (64 MP) palette PNG: over our 40 MP limit, under Pillow's."""
    return uniform_png(8_000, 8_000, bit_depth=1, color_type=3)


def other_format(fmt: str) -> bytes:
    return image_bytes(noise((16, 16)).convert("P" if fmt == "GIF" else "RGB"), fmt)


SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'


def data_uri(data: bytes, subtype: str = "png") -> str:
    return f"data:image/{subtype};base64,{base64.b64encode(data).decode()}"


def bad_crc_png() -> bytes:
    data = bytearray(png())
    data[29] ^= 0xFF  # inside the IHDR checksum
    return bytes(data)


# --------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Context:
    api: Api
    foreign_reference: str  # a transaction of another tenant


@dataclass(frozen=True)
class Spec:
    path: str = "/face-search"
    method: str = "POST"
    kwargs: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    authenticated: bool = True


def file_part(file: bytes | None, name: str) -> dict[str, Any]:
    """The multipart `file` part; without one, a part with no filename keeps the body multipart."""
    if file is None:
        return {"comment": (None, b"no file here")}
    return {"file": (name, file, "application/octet-stream")}


def search_form(file: bytes | None = None, name: str = "face.png", **fields: Any) -> Spec:
    files = file_part(file, name)
    return Spec(kwargs={"data": {"type": "face_search", **fields}, "files": files})


def age_form(file: bytes | None = None, name: str = "face.jpg", **fields: Any) -> Spec:
    files = file_part(file, name)
    return Spec("/age-estimation", kwargs={"data": {"type": "age_estimation", **fields}, "files": files})


def search_json(**fields: Any) -> Spec:
    body = {"type": "face_search", "file": data_uri(png()), **fields}
    return Spec(kwargs={"json": {key: value for key, value in body.items() if value is not Ellipsis}})


def raw(content: bytes, content_type: str | None, path: str = "/face-search") -> Spec:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    return Spec(path, kwargs={"content": content}, headers=headers)


def result_json(body: Any) -> Spec:
    return Spec("/result", kwargs={"json": body})


async def chunks(total: int, size: int = 16 * 1024) -> AsyncIterator[bytes]:
    """A streamed body without Content-Length (chunked transfer encoding)."""
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        sent += piece
        yield b"x" * piece


def multipart_stream(total: int) -> Spec:
    head = (
        b'--bound\r\nContent-Disposition: form-data; name="file"; filename="face.png"\r\n'
        b"Content-Type: image/png\r\n\r\n"
    )

    async def body() -> AsyncIterator[bytes]:
        yield head
        async for piece in chunks(total):
            yield piece
        yield b"\r\n--bound--\r\n"

    return Spec(kwargs={"content": body()}, headers={"Content-Type": "multipart/form-data; boundary=bound"})


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    spec: Callable[[Context], Spec]
    error_field: str | None = None  # a key expected in the envelope's errors


CASES: list[Case] = [
    # Bodies and content types.
    Case("empty JSON body", 422, lambda c: raw(b"", "application/json"), "body"),
    Case("whitespace JSON body", 422, lambda c: raw(b"  \n ", "application/json"), "body"),
    Case("content type text/plain", 415, lambda c: raw(b"type=face_search", "text/plain"), "content-type"),
    Case("content type application/xml", 415, lambda c: raw(b"<a/>", "application/xml"), "content-type"),
    Case("no content type", 415, lambda c: raw(b'{"type":"face_search"}', None), "content-type"),
    Case("JSON array", 422, lambda c: raw(b'[{"type":"face_search"}]', "application/json"), "body"),
    Case("JSON string", 422, lambda c: raw(b'"face_search"', "application/json"), "body"),
    Case("JSON null", 422, lambda c: raw(b"null", "application/json"), "body"),
    Case("JSON syntax error", 422, lambda c: raw(b'{"type": "face_search",', "application/json"), "body"),
    Case("JSON invalid UTF-8", 422, lambda c: raw(b'{"type": "\xff\xfe"}', "application/json"), "body"),
    Case(
        "JSON nested 100k deep",
        422,
        lambda c: raw(b"[" * 100_000 + b"]" * 100_000, "application/json"),
        "body",
    ),
    Case(
        "JSON 5000-digit integer",
        422,
        lambda c: raw(b'{"type": "face_search", "allow_override": ' + b"9" * 5000 + b"}", "application/json"),
        "body",
    ),
    Case(
        "JSON lone surrogate in client_reference",
        422,
        lambda c: raw(
            b'{"type":"face_search","client_reference":"\\ud800abcdef","file":"'
            + data_uri(png()).encode()
            + b'"}',
            "application/json",
        ),
        "body",
    ),
    Case("multipart without boundary", 422, lambda c: raw(b"--x\r\n", "multipart/form-data"), "body"),
    Case(
        "multipart with three files",
        422,
        lambda c: Spec(
            kwargs={
                "data": {"type": "face_search"},
                "files": [("file", ("a.png", png(), "image/png"))] * 3,
            }
        ),
        "body",
    ),
    Case(
        "multipart with 30 fields",
        422,
        lambda c: Spec(
            kwargs={
                "data": {"type": "face_search", **{f"extra{n}": "x" for n in range(30)}},
                "files": {"file": ("a.png", png(), "image/png")},
            }
        ),
        "body",
    ),
    # Image files.
    Case("truncated JPEG", 422, lambda c: search_form(jpg()[: len(jpg()) // 2], "face.jpg"), "file"),
    Case("truncated PNG", 422, lambda c: search_form(png()[: len(png()) // 2]), "file"),
    Case("PNG signature only", 422, lambda c: search_form(png()[:8]), "file"),
    Case("PNG with a broken header checksum", 422, lambda c: search_form(bad_crc_png()), "file"),
    Case(
        "JPEG magic then garbage", 422, lambda c: search_form(b"\xff\xd8\xff" + b"junk" * 50, "a.jpg"), "file"
    ),
    Case("zero-byte file", 422, lambda c: search_form(b"", "face.jpg"), "file"),
    Case("text file named .jpg", 415, lambda c: search_form(b"just some text\n" * 20, "face.jpg"), "file"),
    Case("GIF named .png", 415, lambda c: search_form(other_format("GIF")), "file"),
    Case("WebP named .png", 415, lambda c: search_form(other_format("WEBP")), "file"),
    Case("BMP named .png", 415, lambda c: search_form(other_format("BMP")), "file"),
    Case("TIFF named .png", 415, lambda c: search_form(other_format("TIFF")), "file"),
    Case("SVG named .png", 415, lambda c: search_form(SVG), "file"),
    Case("PNG named .gif", 415, lambda c: search_form(png(), "face.gif"), "file"),
    Case("PNG named without extension", 415, lambda c: search_form(png(), "face"), "file"),
    Case("20000x20000 1-bit PNG (400 MP)", 413, lambda c: search_form(huge_bilevel_png()), "file"),
    Case("8000x8000 palette PNG (64 MP)", 413, lambda c: age_form(large_palette_png(), "a.png"), "file"),
    Case(
        "file over the upload limit, under the body limit",
        413,
        lambda c: search_form(png() + bytes(MAX_UPLOAD + 100 - len(png()))),
        "file",
    ),
    Case(
        "body over the limit by Content-Length",
        413,
        lambda c: search_form(png() + bytes(MIDDLEWARE_LIMIT)),
        "body",
    ),
    Case(
        "chunked JSON body over the limit",
        413,
        lambda c: Spec(
            kwargs={"content": chunks(MIDDLEWARE_LIMIT + 1)}, headers={"Content-Type": "application/json"}
        ),
        "body",
    ),
    Case(
        "chunked multipart body over the limit", 413, lambda c: multipart_stream(MIDDLEWARE_LIMIT + 1), "body"
    ),
    # The data URI of the JSON form.
    Case(
        "base64 without the data URI prefix",
        422,
        lambda c: search_json(file=base64.b64encode(png()).decode()),
        "file",
    ),
    Case("invalid base64", 422, lambda c: search_json(file="data:image/png;base64,@@@not base64@@@"), "file"),
    Case(
        "base64 with bad padding",
        422,
        lambda c: search_json(file="data:image/png;base64,iVBORw0KGgo="),
        "file",
    ),
    Case(
        "data URI data:text/plain",
        422,
        lambda c: search_json(file="data:text/plain;base64," + base64.b64encode(b"hello").decode()),
        "file",
    ),
    Case("data URI image/gif", 415, lambda c: search_json(file=data_uri(other_format("GIF"), "gif")), "file"),
    Case("data URI image/svg+xml", 415, lambda c: search_json(file=data_uri(SVG, "svg+xml")), "file"),
    Case(
        "data URI image/png holding a GIF",
        415,
        lambda c: search_json(file=data_uri(other_format("GIF"))),
        "file",
    ),
    Case("data URI with an empty payload", 422, lambda c: search_json(file="data:image/png;base64,"), "file"),
    Case("file is a number", 422, lambda c: search_json(file=12345), "file"),
    Case("file is null", 422, lambda c: search_json(file=None), "file"),
    Case("file missing (JSON)", 422, lambda c: search_json(file=...), "file"),
    # Fields.
    Case("unknown type", 422, lambda c: search_json(type="selfie"), "type"),
    Case("missing type", 422, lambda c: search_json(type=...), "type"),
    Case("age type on /face-search", 422, lambda c: search_json(type="age_estimation"), "type"),
    Case(
        "client_reference of 4 characters",
        422,
        lambda c: search_json(client_reference="abcd"),
        "client_reference",
    ),
    Case(
        "client_reference of 256 characters",
        422,
        lambda c: search_json(client_reference="r" * 256),
        "client_reference",
    ),
    Case(
        "client_reference not a string",
        422,
        lambda c: search_json(client_reference=123456),
        "client_reference",
    ),
    Case(
        "client_reference with a control character",
        422,
        lambda c: search_json(client_reference="abc\x00def"),
        "client_reference",
    ),
    Case(
        "allow_override=1 without client_reference (JSON)",
        422,
        lambda c: search_json(allow_override=1),
        "client_reference",
    ),
    Case(
        "allow_override=true without client_reference",
        422,
        lambda c: search_json(allow_override=True),
        "client_reference",
    ),
    Case(
        "allow_override=1 without client_reference (form)",
        422,
        lambda c: search_form(png(), allow_override="1"),
        "client_reference",
    ),
    Case(
        "allow_override=2",
        422,
        lambda c: search_json(allow_override=2, client_reference="abcde"),
        "allow_override",
    ),
    Case("allow_override=yes", 422, lambda c: search_form(png(), allow_override="yes"), "allow_override"),
    Case("enroll_face=maybe", 422, lambda c: search_form(png(), enroll_face="maybe"), "enroll_face"),
    Case("enroll_face is a list", 422, lambda c: search_json(enroll_face=[1]), "enroll_face"),
    Case("wait_for_result=2", 422, lambda c: age_form(jpg(), wait_for_result="2"), "wait_for_result"),
    Case("wait_for_result=true", 422, lambda c: age_form(jpg(), wait_for_result="true"), "wait_for_result"),
    Case("age type wrong", 422, lambda c: age_form(jpg(), type="face_search"), "type"),
    Case(
        "multipart file sent as a plain string",
        422,
        lambda c: Spec(kwargs={"data": {"type": "face_search"}, "files": {"file": (None, b"abc")}}),
        "file",
    ),
    Case(
        "urlencoded form on /face-search",
        415,
        lambda c: Spec(kwargs={"data": {"type": "face_search", "file": "abc"}}),
        "content-type",
    ),
    Case("multipart file missing", 422, lambda c: search_form(None), "file"),
    Case("age file missing", 422, lambda c: age_form(None), "file"),
    Case(
        "JSON body on /age-estimation",
        415,
        lambda c: Spec("/age-estimation", kwargs={"json": {"type": "age_estimation"}}),
        "content-type",
    ),
    # The result endpoint.
    Case("result without reference_id", 422, lambda c: result_json({}), "reference_id"),
    Case(
        "result with an empty reference_id", 422, lambda c: result_json({"reference_id": ""}), "reference_id"
    ),
    Case(
        "result with a numeric reference_id", 422, lambda c: result_json({"reference_id": 42}), "reference_id"
    ),
    Case(
        "result with an unknown reference_id",
        422,
        lambda c: result_json({"reference_id": "f" * 32}),
        "reference_id",
    ),
    Case(
        "result with another tenant's reference_id",
        422,
        lambda c: result_json({"reference_id": c.foreign_reference}),
        "reference_id",
    ),
    Case(
        "result with a lone surrogate",
        422,
        lambda c: raw(b'{"reference_id": "\\udc00"}', "application/json", "/result"),
        "body",
    ),
    Case("result as a JSON array", 422, lambda c: result_json([c.foreign_reference]), "body"),
    Case(
        "result as text/plain", 415, lambda c: raw(b"reference_id=x", "text/plain", "/result"), "content-type"
    ),
    # Routing and credentials.
    Case("unknown endpoint", 404, lambda c: Spec("/no-such-endpoint")),
    Case("GET on /face-search", 405, lambda c: Spec(method="GET")),
    Case("PUT on /result", 405, lambda c: Spec("/result", method="PUT")),
    Case(
        "garbage proof token",
        404,
        lambda c: Spec("/get-proof/not-a-token", method="GET", authenticated=False),
    ),
    Case("no credentials", 401, lambda c: Spec(kwargs=search_json().kwargs, authenticated=False)),
    Case(
        "Basic instead of Bearer",
        401,
        lambda c: Spec(
            kwargs=search_json().kwargs, headers={"Authorization": "Basic YTpi"}, authenticated=False
        ),
    ),
    Case(
        "Bearer with garbage",
        401,
        lambda c: Spec(
            kwargs=search_json().kwargs, headers={"Authorization": "Bearer a.b.c"}, authenticated=False
        ),
    ),
]


def test_the_table_is_large_and_its_names_unique() -> None:
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_request_gets_a_clean_4xx(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        api = await build_api(max_upload_bytes=MAX_UPLOAD)
        foreign_client, _ = await api.new_client("tenant-b")
        async with api.http() as http:
            created = await http.post(
                "/face-search",
                data={"type": "face_search"},
                files={"file": ("a.png", png(), "image/png")},
                headers=api.headers(foreign_client),
            )
            assert created.status_code == 200
            context = Context(api, created.json()["result"]["data"]["reference_id"])
            spec = case.spec(context)
            headers = {**(api.headers() if spec.authenticated else {}), **spec.headers}
            response = await asyncio.wait_for(
                http.request(spec.method, spec.path, headers=headers, **spec.kwargs), timeout=15
            )
        assert response.status_code == case.status, response.text
        body = response.json()
        assert_error_envelope(body)
        if case.error_field is not None:
            assert case.error_field in body["errors"], body
        assert "Traceback" not in response.text
        # Refused requests create nothing: only the other tenant's transaction exists.
        assert await api.world.transactions.count_by_state() == {
            "queued": 1,
            "processing": 0,
            "completed": 0,
            "failed": 0,
        }

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def test_an_oversized_content_length_is_refused_before_the_body_is_read() -> None:
    async def scenario() -> None:
        api = await build_api(max_upload_bytes=MAX_UPLOAD)
        app = create_app(api.services)
        sent: list[Message] = []

        async def receive() -> Message:
            raise AssertionError("the body was read")

        async def send(message: Message) -> None:
            sent.append(message)

        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/face-search",
            "raw_path": b"/face-search",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"testserver"),
                (b"content-type", b"multipart/form-data; boundary=xyz"),
                (b"content-length", str(MIDDLEWARE_LIMIT + 1).encode()),
                (b"authorization", f"Bearer {api.token()}".encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
        start, body = sent[0], sent[1]
        assert start["type"] == "http.response.start"
        assert start["status"] == 413
        assert (b"connection", b"close") in start["headers"]
        assert_error_envelope(json.loads(body["body"]))

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------- must work


def exif_rotated_jpeg() -> bytes:
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    return image_bytes(image, "JPEG", exif=exif, quality=95)


def mpo_jpeg() -> bytes:
    second = Image.new("RGB", (64, 48), (0, 0, 0))
    return image_bytes(noise(), "MPO", save_all=True, append_images=[second])


VALID_IMAGES: dict[str, tuple[Callable[[], bytes], str]] = {
    "CMYK JPEG": (lambda: image_bytes(Image.new("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG"), "jpg"),
    "progressive JPEG": (lambda: image_bytes(noise(), "JPEG", progressive=True), "jpg"),
    "grayscale JPEG": (lambda: image_bytes(noise().convert("L"), "JPEG"), "jpeg"),
    "EXIF-rotated JPEG": (exif_rotated_jpeg, "jpg"),
    "MPO JPEG (phone camera)": (mpo_jpeg, "jpg"),
    "16-bit grayscale PNG": (
        lambda: image_bytes(Image.fromarray(np.arange(1024, dtype=np.uint16).reshape(32, 32) * 64), "PNG"),
        "png",
    ),
    "16-bit RGB PNG": (lambda: uniform_png(4, 4, 16, 2, bytes(range(24))), "png"),
    "grayscale PNG": (lambda: image_bytes(noise().convert("L"), "PNG"), "png"),
    "1-bit PNG": (lambda: image_bytes(noise().convert("1"), "PNG"), "png"),
    "RGBA PNG": (lambda: image_bytes(noise().convert("RGBA"), "PNG"), "png"),
    "LA PNG": (lambda: image_bytes(noise().convert("LA"), "PNG"), "png"),
    "palette PNG": (lambda: image_bytes(noise().convert("P"), "PNG"), "png"),
    "palette PNG with transparency": (
        lambda: image_bytes(noise().convert("P"), "PNG", transparency=0),
        "png",
    ),
    "PNG named .JPG": (png, "JPG"),
}


@pytest.mark.parametrize("name", list(VALID_IMAGES))
def test_unusual_but_valid_images_are_accepted_and_processed(name: str) -> None:
    make, extension = VALID_IMAGES[name]
    data = make()

    async def scenario() -> None:
        api = await build_api(max_upload_bytes=MAX_UPLOAD)
        async with api.http() as http:
            upload = {"file": (f"face.{extension}", data, "application/octet-stream")}
            responses = [
                await http.post(
                    "/face-search", data={"type": "face_search"}, files=upload, headers=api.headers()
                ),
                await http.post(
                    "/age-estimation", data={"type": "age_estimation"}, files=upload, headers=api.headers()
                ),
                await http.post(
                    "/face-search",
                    json={"type": "face_search", "file": data_uri(data, "jpeg" if "JPEG" in name else "png")},
                    headers=api.headers(),
                ),
            ]
        for response in responses:
            assert response.status_code == 200, response.text
            reference_id = response.json()["result"]["data"]["reference_id"]
            await api.world.processor().process(reference_id)
            assert api.world.transactions.peek(reference_id).state is TransactionState.COMPLETED
        assert len(api.world.analysis.calls) == 3

    asyncio.run(scenario())


def test_the_image_limit_counts_pixels_not_bytes() -> None:
    """A small file that is exactly at the pixel limit passes; one pixel row more is refused."""

    async def scenario() -> None:
        api = await build_api(max_upload_bytes=MAX_UPLOAD, max_image_pixels=1000 * 1000)
        async with api.http() as http:
            at_limit = await http.post(
                "/face-search",
                data={"type": "face_search"},
                files={"file": ("a.png", uniform_png(1000, 1000, 1, 0), "image/png")},
                headers=api.headers(),
            )
            over = await http.post(
                "/face-search",
                data={"type": "face_search"},
                files={"file": ("a.png", uniform_png(1000, 1001, 1, 0), "image/png")},
                headers=api.headers(),
            )
        assert at_limit.status_code == 200
        assert over.status_code == 413
        assert_error_envelope(over.json())

    asyncio.run(scenario())

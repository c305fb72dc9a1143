"""The API edge (issue 10): identifiers checked against their issued form, and failures behind the service
answered with a fixed message per error class while the details go to the log."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest
from pymilvus.exceptions import MilvusException
from redis import exceptions as redis_exceptions

from serve_app.api.limits import client_source, parse_networks
from serve_app.domain.errors import BackendUnavailable, ModelUnavailable, ServiceError
from serve_app.domain.identifiers import new_client_id, new_client_secret, new_reference_id
from serve_app.stores.milvus_gallery import MilvusGalleryStore
from serve_app.stores.redis_support import to_backend_unavailable
from tests.backend_text import assert_no_backend_text
from tests.unit.fakes import build_api


def test_result_refuses_values_that_are_not_issued_reference_ids_before_the_store() -> None:
    async def scenario() -> None:
        api = await build_api()
        looked_up: list[str] = []
        original = api.world.transactions.get

        async def spy(reference_id: str) -> Any:
            looked_up.append(reference_id)
            return await original(reference_id)

        api.world.transactions.get = spy  # type: ignore[method-assign]
        async with api.http() as http:
            for value in ["counts", "queue", "f" * 31, "F" * 32, "g" * 32, "a" * 32 + " "]:
                response = await http.post("/result", headers=api.headers(), json={"reference_id": value})
                assert response.status_code == 422, value
                assert response.json()["errors"] == {"reference_id": "must be 32 lowercase hex digits"}
        assert looked_up == []

    asyncio.run(scenario())


def backend_errors() -> list[ServiceError]:
    refused = redis_exceptions.ConnectionError("Error 111 connecting to 10.1.2.3:6379. Connection refused.")
    wrongtype = redis_exceptions.ResponseError(
        "WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    milvus = MilvusException(
        code=2, message="Fail connecting to server on milvus.internal:19530, illegal connection"
    )
    return [
        to_backend_unavailable(refused),
        to_backend_unavailable(wrongtype),
        MilvusGalleryStore._unavailable(milvus),
        ModelUnavailable("ray.exceptions.RayActorError: The actor died unexpectedly: node 10.1.2.4"),
    ]


@pytest.mark.parametrize("error", backend_errors(), ids=lambda error: type(error).__name__)
def test_backend_text_never_reaches_a_response(error: ServiceError, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        api = await build_api()

        async def failing(reference_id: str) -> Any:
            raise error

        api.world.transactions.get = failing  # type: ignore[method-assign]
        reference_id = "0123456789abcdef0123456789abcdef"
        async with api.http() as http:
            with caplog.at_level(logging.WARNING, logger="serve_app.api.errors"):
                response = await http.post(
                    "/result", headers=api.headers(), json={"reference_id": reference_id}
                )
        assert response.status_code == 503
        assert response.json() == {"status": False, "message": type(error).public_message, "errors": {}}
        assert_no_backend_text(response.text, ports=[6379, 19530])
        for word in ("10.1.2.3", "milvus.internal", "RayActorError"):
            assert word not in response.text
        logged = [record.getMessage() for record in caplog.records]
        assert any(error.message in line and reference_id in line for line in logged), logged

    asyncio.run(scenario())


def test_every_backend_error_class_has_a_fixed_public_message() -> None:
    for error_class in (BackendUnavailable, ModelUnavailable):
        assert error_class.public_message and "{" not in error_class.public_message


def test_multipart_parser_text_is_not_echoed() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            response = await http.post(
                "/face-search",
                headers={**api.headers(), "Content-Type": "multipart/form-data; boundary=xyz"},
                content=b"\xff\xfe--xyz",  # the parser: "Expected boundary character 45, got 255"
            )
        assert response.status_code == 422
        assert response.json()["errors"] == {"body": "malformed form data"}
        assert "boundary character" not in response.text

    asyncio.run(scenario())


def test_client_source_takes_the_right_most_untrusted_address() -> None:
    trusted = parse_networks(["10.0.0.0/8", "fd00::/8"])
    assert client_source("192.0.2.1", ["198.51.100.1"], trusted) == "192.0.2.1"  # untrusted peer
    assert client_source("192.0.2.1", ["198.51.100.1"], ()) == "192.0.2.1"  # no trusted proxies
    assert client_source("10.0.0.1", ["198.51.100.1"], trusted) == "198.51.100.1"
    assert client_source("10.0.0.1", ["6.6.6.6, 198.51.100.1"], trusted) == "198.51.100.1"
    assert client_source("10.0.0.1", ["198.51.100.1", "10.0.0.2"], trusted) == "198.51.100.1"
    assert client_source("10.0.0.1", ["10.0.0.3, 10.0.0.2"], trusted) == "10.0.0.3"  # all trusted
    assert client_source("10.0.0.1", ["198.51.100.1, not-an-ip"], trusted) == "10.0.0.1"
    assert client_source("10.0.0.1", [], trusted) == "10.0.0.1"
    assert client_source("::ffff:192.0.2.1", [], trusted) == "192.0.2.1"
    # One host can hold a whole IPv6 /64: it is one source.
    assert client_source("2001:db8:1:2::1", [], ()) == client_source("2001:db8:1:2:ffff::9", [], ())
    assert client_source("2001:db8:1:2::1", [], ()) != client_source("2001:db8:1:3::1", [], ())
    assert client_source(None, [], trusted) == client_source("garbage", [], trusted) == "unknown"


def test_openapi_states_the_identifier_forms_and_the_login_429() -> None:
    async def scenario() -> dict[str, Any]:
        api = await build_api()
        async with api.http() as http:
            return dict((await http.get("/openapi.json")).json())

    paths = asyncio.run(scenario())["paths"]
    result_body = paths["/result"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    token_body = paths["/request-access-token"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    reference_pattern = result_body["properties"]["reference_id"]["pattern"]
    client_pattern = token_body["properties"]["client_id"]["pattern"]
    assert re.fullmatch(reference_pattern.strip("^$"), new_reference_id())
    assert not re.fullmatch(reference_pattern.strip("^$"), "counts")
    assert re.fullmatch(client_pattern.strip("^$"), new_client_id())
    assert "429" in paths["/request-access-token"]["post"]["responses"]
    assert "429" in paths["/get-proof/{proof_token}"]["get"]["responses"]


def test_client_secrets_never_start_like_a_command_line_option(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn = iter(["-leading-dash", "_fine-secret"])
    monkeypatch.setattr("serve_app.domain.identifiers.secrets.token_urlsafe", lambda _n: next(drawn))
    assert new_client_secret() == "_fine-secret"

"""Finished results through the whole service (real models, Redis, milvus-lite, the worker's archiver):
an erasure reaches every result read after it, and a result past Redis' hot window is served from the
result archive exactly as before. The session's service runs with a hot window of a few seconds
(conftest.py), so the archiver moves results while these tests wait.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serve_app.domain.transactions import Transaction, TransactionKind, TransactionState, upload_key
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_support import connect_redis
from serve_app.stores.result_archive import archive_key
from serve_app.wiring.stores import redis_stores
from tests.faces_dev import FacesDev
from tests.integration.api_client import (
    age_estimation,
    auth,
    face_search_json,
    reference_of,
    wait_result,
)
from tests.service_harness import Client, RunningService

pytestmark = pytest.mark.service

# A proof URL carries a token minted when the result is read (it expires): the one part of a result that
# differs between two reads by design.
_PROOF_TOKEN = re.compile(rb"/get-proof/[A-Za-z0-9_.-]+")


@pytest.fixture(scope="module")
def http(service: RunningService) -> Iterator[httpx.Client]:
    with service.http() as client:
        yield client


def read(http: httpx.Client, token: str, reference_id: str) -> httpx.Response:
    response = http.post("/result", json={"reference_id": reference_id}, headers=auth(token))
    assert response.status_code == 200, response.text
    return response


def matched(response: httpx.Response) -> list[list[Any]]:
    faces: list[list[Any]] = response.json()["result"]["data"]["face_search_response"]["result"][
        "matched_faces"
    ]
    return faces


def proof_path(url: str, service: RunningService) -> str:
    return url.removeprefix(service.base_url)


def in_redis(service: RunningService, reference_ids: list[str]) -> list[bool]:
    """Whether Redis still holds each transaction (its hash)."""

    async def check() -> list[bool]:
        redis = connect_redis(str(service.settings.redis.url))
        try:
            prefix = service.settings.redis.key_prefix
            return [bool(await redis.exists(f"{prefix}txn:{reference_id}")) for reference_id in reference_ids]
        finally:
            await redis.aclose()

    return asyncio.run(check())


def test_a_result_past_the_hot_window_is_served_byte_identical_from_the_archive(
    service: RunningService, http: httpx.Client, faces_dev: FacesDev
) -> None:
    token = service.token_for(service.new_client("archive-tests"))
    (first, photos), (_, others) = list(faces_dev.by_identity().items())[:2]
    enrolment = reference_of(
        face_search_json(http, token, photos[0].path, client_reference=f"archive-{first}")
    )
    wait_result(http, token, enrolment)
    search = reference_of(face_search_json(http, token, photos[1].path, enroll_face=False))
    age = reference_of(age_estimation(http, token, others[0].path, enroll_face=0))
    references = [enrolment, search, age]
    for reference_id in references:
        wait_result(http, token, reference_id)
    before = [read(http, token, reference_id) for reference_id in references]
    assert [m[3] for m in matched(before[1])] == [f"archive-{first}"]

    # The archiver moves them a few seconds after they became final (the hot window of this session).
    deadline = time.monotonic() + 120
    while any(in_redis(service, references)):
        assert time.monotonic() < deadline, "results still in Redis long after the hot window"
        time.sleep(0.5)
    archived = LocalBlobStore(service.settings.results)
    stored = [asyncio.run(archived.get(archive_key(reference_id))) for reference_id in references]
    for document in stored:
        assert document is not None
        # What Redis held, not a rendering: no proof URL.
        assert {"tenant_id", "kind", "state", "created_at", "updated_at"} <= set(json.loads(document[0]))
        assert b"get-proof" not in document[0]
    # The search's matches are kept as face ids and scores: their references are joined when read.
    assert stored[1] is not None and f"archive-{first}".encode() not in stored[1][0]

    after = [read(http, token, reference_id) for reference_id in references]
    for old, new in zip(before, after, strict=True):
        assert _PROOF_TOKEN.sub(b"/get-proof/-", new.content) == _PROOF_TOKEN.sub(
            b"/get-proof/-", old.content
        )
        assert new.headers["content-type"] == old.headers["content-type"]
    # The proof URL of an archived result serves the enrolled image.
    proof = http.get(proof_path(matched(after[1])[0][2], service))
    assert proof.status_code == 200 and proof.content == photos[0].path.read_bytes()


def test_an_erased_reference_vanishes_from_results_and_is_not_enrolled_again(
    service: RunningService, http: httpx.Client, faces_dev: FacesDev
) -> None:
    client = service.new_client("erasure-tests")
    token = service.token_for(client)
    identity, photos = list(faces_dev.by_identity().items())[2]
    reference = f"erase-{identity}-{uuid.uuid4().hex[:6]}"
    enrolment = reference_of(face_search_json(http, token, photos[0].path, client_reference=reference))
    wait_result(http, token, enrolment)
    search = reference_of(face_search_json(http, token, photos[1].path, enroll_face=False))
    wait_result(http, token, search)
    [(face_id, _score, proof_url, named)] = matched(read(http, token, search))
    assert (face_id, named) == (f"f{enrolment}", reference)
    assert http.get(proof_path(proof_url, service)).status_code == 200

    erasure = http.post("/gallery/erasures", json={"client_reference": reference}, headers=auth(token))
    assert erasure.status_code == 200, erasure.text
    assert erasure.json()["result"]["data"]["faces_erased"] == 1

    # A result finished before the erasure: the match is gone, with its proof image.
    after = read(http, token, search)
    assert matched(after) == [] and reference.encode() not in after.content
    assert http.get(proof_path(proof_url, service)).status_code == 404
    # The enrolling transaction's own result no longer names the reference either.
    own = read(http, token, enrolment)
    assert own.json()["result"]["data"]["client_reference"] == ""
    assert reference.encode() not in own.content

    # A transaction accepted before the erasure (its queue entry written then) but processed after it.
    late = asyncio.run(accept_before_erasure(service, client, reference, photos[1].path.read_bytes()))
    late_result = wait_result(http, token, late)
    assert late_result["result"]["data"]["client_reference"] == ""
    listing = http.get("/gallery/faces", params={"client_reference": reference}, headers=auth(token))
    assert listing.status_code == 200 and listing.json()["result"]["data"]["faces"] == []
    again = reference_of(face_search_json(http, token, photos[1].path, enroll_face=False))
    wait_result(http, token, again)
    assert matched(read(http, token, again)) == []


async def accept_before_erasure(service: RunningService, client: Client, reference: str, image: bytes) -> str:
    """What the ingress writes for an enrolment of `reference` (upload, then transaction and queue entry),
    stamped as accepted just before the reference's erasure: the worker processes it after the erasure."""
    stores = redis_stores(service.settings)
    erased_at = await stores.records.erased_at(client.client_id, reference)
    assert erased_at is not None
    reference_id = uuid.uuid4().hex
    tx = Transaction(
        reference_id=reference_id,
        tenant_id=client.client_id,
        kind=TransactionKind.FACE_SEARCH,
        state=TransactionState.QUEUED,
        created_at=erased_at - 0.5,
        updated_at=erased_at - 0.5,
        image_key=upload_key(client.client_id, reference_id),
        enroll_face=True,
        client_reference=reference,
    )
    await LocalBlobStore(service.settings.blobs).put(tx.image_key, image, "image/jpeg")
    await stores.transactions.create_and_enqueue(tx)
    await stores.transactions.redis.aclose()
    return reference_id

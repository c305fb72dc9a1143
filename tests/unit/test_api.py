"""The REST interface end to end over fake stores: create, result states and shapes, proofs, tenancy."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import httpx
import pytest

from serve_app.domain.transactions import TransactionKind, TransactionState
from serve_app.pipelines.processing import enrolled_face_id
from serve_app.pipelines.worker import QueueWorker, WorkerPolicy
from tests.unit.fakes import Api, Color, World, build_api, embedding, face, face_quality, solid_png

RED: Color = (200, 30, 30)
GREEN: Color = (30, 200, 30)
BLUE: Color = (30, 30, 200)


def png_upload(color: Color, name: str = "face.png") -> dict[str, tuple[str, bytes, str]]:
    return {"file": (name, solid_png(color), "image/png")}


async def create_search(
    api: Api, http: httpx.AsyncClient, color: Color, client_reference: str | None = None
) -> str:
    data = {"type": "face_search"}
    if client_reference is not None:
        data["client_reference"] = client_reference
    response = await http.post("/face-search", data=data, files=png_upload(color), headers=api.headers())
    assert response.status_code == 200, response.text
    return str(response.json()["result"]["data"]["reference_id"])


async def create_age(api: Api, http: httpx.AsyncClient, color: Color, **fields: str) -> httpx.Response:
    return await http.post(
        "/age-estimation",
        data={"type": "age_estimation", **fields},
        files=png_upload(color),
        headers=api.headers(),
    )


async def result(api: Api, http: httpx.AsyncClient, reference_id: str, client_id: str | None = None) -> Any:
    return await http.post("/result", json={"reference_id": reference_id}, headers=api.headers(client_id))


def test_create_face_search_answers_the_create_envelope_and_persists_the_transaction() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            response = await http.post(
                "/face-search",
                data={"type": "face_search", "client_reference": "customer-1", "allow_override": "1"},
                files=png_upload(RED),
                headers=api.headers(),
            )
            assert response.status_code == 200
            body = response.json()
            assert set(body) == {"status", "message", "result"}
            assert body["status"] is True and body["message"]
            assert set(body["result"]) == {"data"} and set(body["result"]["data"]) == {"reference_id"}
            reference_id = body["result"]["data"]["reference_id"]

            uri = "data:image/png;base64," + base64.b64encode(solid_png(GREEN)).decode()
            json_response = await http.post(
                "/face-search",
                json={"type": "face_search", "file": uri, "enroll_face": False, "allow_override": 0},
                headers=api.headers(),
            )
            assert json_response.status_code == 200, json_response.text
            other_id = json_response.json()["result"]["data"]["reference_id"]

        tx = api.world.transactions.peek(reference_id)
        assert tx.kind is TransactionKind.FACE_SEARCH
        assert tx.state is TransactionState.QUEUED
        assert tx.tenant_id == api.client_id
        assert (tx.client_reference, tx.allow_override, tx.enroll_face) == ("customer-1", True, True)
        assert api.world.blobs.items[tx.image_key] == (solid_png(RED), "image/png")
        other = api.world.transactions.peek(other_id)
        assert (other.client_reference, other.allow_override, other.enroll_face) == (None, False, False)
        assert api.world.queue.undelivered == 2

    asyncio.run(scenario())


def test_a_pending_result_is_202_with_its_state_and_retry_after() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            reference_id = await create_search(api, http, RED)
            queued = await result(api, http, reference_id)
            assert queued.status_code == 202
            assert queued.headers["Retry-After"] == "1"
            assert queued.json()["status"] is True
            assert queued.json()["result"]["data"] == {"reference_id": reference_id, "state": "queued"}

            await api.world.transactions.mark_processing(reference_id)
            processing = await result(api, http, reference_id)
            assert processing.status_code == 202
            assert processing.json()["result"]["data"] == {
                "reference_id": reference_id,
                "state": "processing",
            }

    asyncio.run(scenario())


def test_a_final_face_search_result_has_exactly_the_interface_fields() -> None:
    async def scenario() -> None:
        api = await build_api()
        probe = embedding(1)
        api.world.analysis.faces_by_color[RED] = [face(probe)]
        api.world.analysis.faces_by_color[BLUE] = [face(probe)]
        async with api.http() as http:
            enrolled_ref = await create_search(api, http, RED, client_reference="customer-1")
            await api.world.processor().process(enrolled_ref)
            probe_ref = await create_search(api, http, BLUE, client_reference="customer-2")
            await api.world.processor().process(probe_ref)

            before = int(time.time())
            response = await result(api, http, probe_ref)
            assert response.status_code == 200, response.text
            body = response.json()
            assert set(body) == {"status", "message", "result"}
            assert body["status"] is True
            assert set(body["result"]) == {"data"}
            data = body["result"]["data"]
            assert set(data) == {"service_reference_id", "client_reference", "face_search_response"}
            assert data["service_reference_id"] == probe_ref
            assert data["client_reference"] == "customer-2"
            assert set(data["face_search_response"]) == {"result"}
            outcome = data["face_search_response"]["result"]
            assert set(outcome) == {"matched_faces", "is_face_found"}
            assert outcome["is_face_found"] is True
            [entry] = outcome["matched_faces"]
            assert isinstance(entry, list) and len(entry) == 4
            face_id, score, url, client_reference = entry
            assert face_id == enrolled_face_id(enrolled_ref)
            assert isinstance(score, float) and 0.5 <= score <= 1.0
            assert client_reference == "customer-1"
            prefix = "http://testserver/get-proof/"
            assert url.startswith(prefix)
            claims = api.signer.verify_proof(url[len(prefix) :])
            assert (claims.tenant_id, claims.face_id) == (api.client_id, face_id)
            assert before + 900 <= claims.expires_at <= int(time.time()) + 900  # 15 minutes from issue

            proof = await http.get(url)  # the URL alone is the credential
            assert proof.status_code == 200
            assert proof.content == solid_png(RED)
            assert proof.headers["content-type"] == "image/png"
            assert proof.headers["cache-control"].startswith("private, max-age=")
            assert 0 < int(proof.headers["cache-control"].rsplit("=", 1)[1]) <= 900

    asyncio.run(scenario())


def test_proof_urls_use_the_public_base_url_when_configured() -> None:
    async def scenario() -> None:
        api = await build_api(public_base_url="https://faces.example.com/api")
        api.world.analysis.faces_by_color[RED] = [face(embedding(1))]
        async with api.http() as http:
            first = await create_search(api, http, RED)
            await api.world.processor().process(first)
            second = await create_search(api, http, RED)
            await api.world.processor().process(second)
            response = await result(api, http, second)
        [entry] = response.json()["result"]["data"]["face_search_response"]["result"]["matched_faces"]
        assert entry[2].startswith("https://faces.example.com/api/get-proof/")
        assert entry[3] == ""  # enrolled without a client_reference

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("faces", "is_face_found"),
    [pytest.param(True, True, id="face, no match"), pytest.param(False, False, id="no face")],
)
def test_a_search_without_matches_has_an_empty_list(faces: bool, is_face_found: bool) -> None:
    async def scenario() -> None:
        api = await build_api()
        if faces:
            api.world.analysis.faces_by_color[RED] = [face(embedding(1))]
        async with api.http() as http:
            reference_id = await create_search(api, http, RED)
            await api.world.processor().process(reference_id)
            response = await result(api, http, reference_id)
        assert response.status_code == 200
        data = response.json()["result"]["data"]
        assert data["client_reference"] == ""
        assert data["face_search_response"] == {
            "result": {"matched_faces": [], "is_face_found": is_face_found}
        }

    asyncio.run(scenario())


def test_a_final_age_result_has_exactly_the_interface_fields() -> None:
    async def scenario() -> None:
        api = await build_api()
        api.world.analysis.faces_by_color[GREEN] = [face(embedding(2), age=40, quality=face_quality(True))]
        async with api.http() as http:
            created = await create_age(api, http, GREEN, enroll_face="0")
            reference_id = created.json()["result"]["data"]["reference_id"]
            await api.world.processor().process(reference_id)
            response = await result(api, http, reference_id)
        assert response.status_code == 200
        body = response.json()
        assert body["status"] is True
        assert body["result"]["data"] == {
            "reference_id": reference_id,
            "age": 40,
            "under_18": 0,
            "under_21": 0,
        }
        assert all(type(body["result"]["data"][key]) is int for key in ("age", "under_18", "under_21"))
        assert api.world.gallery.face_ids() == set()

    asyncio.run(scenario())


def test_an_age_result_with_a_50_says_why() -> None:
    async def scenario() -> None:
        api = await build_api()
        api.world.analysis.faces_by_color[GREEN] = [face(embedding(2), age=19, quality=face_quality(True))]
        api.world.analysis.faces_by_color[BLUE] = [face(embedding(3), age=40, quality=face_quality(False))]
        async with api.http() as http:
            data = {}
            for color in (GREEN, BLUE):
                created = await create_age(api, http, color, enroll_face="0")
                reference_id = created.json()["result"]["data"]["reference_id"]
                await api.world.processor().process(reference_id)
                data[color] = (await result(api, http, reference_id)).json()["result"]["data"]
        assert data[GREEN]["under_18"] == 50 and data[GREEN]["age_decision"] == {"reason": "uncertain_age"}
        blurred = data[BLUE]
        assert (blurred["under_18"], blurred["under_21"]) == (50, 50)
        assert blurred["age_decision"]["reason"] == "face_quality"
        assert blurred["age_decision"]["quality"]["reasons"] == ["blurry"]

    asyncio.run(scenario())


def test_an_age_result_without_a_face_has_nulls() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            created = await create_age(api, http, GREEN)
            reference_id = created.json()["result"]["data"]["reference_id"]
            await api.world.processor().process(reference_id)
            response = await result(api, http, reference_id)
        assert response.json()["result"]["data"] == {
            "reference_id": reference_id,
            "age": None,
            "under_18": None,
            "under_21": None,
        }

    asyncio.run(scenario())


def test_a_failed_transaction_answers_the_error_envelope() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            reference_id = await create_search(api, http, RED)
            tx = api.world.transactions.peek(reference_id)
            del api.world.blobs.items[tx.image_key]  # the stored upload is gone: processing must fail
            await api.world.processor().process(reference_id)
            response = await result(api, http, reference_id)
        assert response.status_code == 200
        body = response.json()
        assert set(body) == {"status", "message", "errors", "result"}
        assert body["status"] is False
        assert "failed" in body["message"]
        assert body["errors"] == {"transaction": "The uploaded image is no longer available."}
        assert body["result"] == {"data": {"reference_id": reference_id, "state": "failed"}}

    asyncio.run(scenario())


def test_another_tenants_reference_id_is_422_exactly_like_an_unknown_one() -> None:
    async def scenario() -> None:
        api = await build_api()
        other_client, _ = await api.new_client("tenant-b")
        api.world.analysis.faces_by_color[RED] = [face(embedding(1))]
        async with api.http() as http:
            reference_id = await create_search(api, http, RED, client_reference="customer-1")
            await api.world.processor().process(reference_id)
            foreign = await result(api, http, reference_id, client_id=other_client)
            unknown = await result(api, http, "0" * 32, client_id=other_client)
            own = await result(api, http, reference_id)
        assert foreign.status_code == 422
        assert unknown.status_code == 422
        assert foreign.json() == unknown.json()
        assert foreign.json()["status"] is False
        assert reference_id not in foreign.text and "customer-1" not in foreign.text
        assert own.status_code == 200

    asyncio.run(scenario())


async def api_with_worker_for_a_34_year_old() -> tuple[World, Api, QueueWorker]:
    """An API whose GREEN uploads show one face of age 34, and a (not yet running) worker to finalise them."""
    world = World()
    world.analysis.faces_by_color[GREEN] = [face(embedding(2), age=34, quality=face_quality(True))]
    api = await build_api(world, wait_for_result_timeout_s=5.0)
    policy = WorkerPolicy(
        concurrency=2,
        stale_after_s=30.0,
        max_deliveries=5,
        claim_block_ms=5,
        reclaim_every_s=0.05,
        backoff_s=0.01,
    )
    return world, api, QueueWorker("worker-1", world.queue, world.processor(), policy)


def test_wait_for_result_returns_the_age_result_when_it_is_ready_in_time() -> None:
    async def scenario() -> None:
        world, api, worker = await api_with_worker_for_a_34_year_old()
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            async with api.http() as http:
                response = await create_age(api, http, GREEN, wait_for_result="1")
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["status"] is True
        data = body["result"]["data"]
        assert set(data) == {"reference_id", "age", "under_18", "under_21"}
        assert (data["age"], data["under_18"], data["under_21"]) == (34, 0, 0)
        assert world.transactions.peek(data["reference_id"]).state is TransactionState.COMPLETED
        # Not timed: had the wait not ended with the result, the answer would be 202 (next test).

    asyncio.run(scenario())


def test_wait_for_result_answers_202_when_the_result_is_not_ready_in_time() -> None:
    async def scenario() -> None:
        api = await build_api(wait_for_result_timeout_s=0.2)  # no worker runs: nothing gets finalised
        async with api.http() as http:
            response = await create_age(api, http, GREEN, wait_for_result="1")
        assert response.status_code == 202
        assert response.headers["Retry-After"] == "1"
        data = response.json()["result"]["data"]
        assert data["state"] == "queued"
        assert api.world.transactions.peek(data["reference_id"]).state is TransactionState.QUEUED
        # It waited its whole timeout out, and the transaction was still not final at the end.
        assert api.world.transactions.waits == [(data["reference_id"], 0.2, False)]

    asyncio.run(scenario())


def test_without_wait_for_result_the_age_create_call_answers_at_once() -> None:
    async def scenario() -> None:
        api = await build_api(wait_for_result_timeout_s=5.0)
        async with api.http() as http:
            response = await create_age(api, http, GREEN, wait_for_result="0")
        assert response.status_code == 200
        # 200 with the reference only: a wait would have ended in 202, as nothing finalises it here.
        assert set(response.json()["result"]["data"]) == {"reference_id"}

    asyncio.run(scenario())


def test_result_with_prefer_wait_holds_until_the_transaction_is_final() -> None:
    async def scenario() -> None:
        _world, api, worker = await api_with_worker_for_a_34_year_old()
        async with api.http() as http:
            reference_id = (await create_age(api, http, GREEN)).json()["result"]["data"]["reference_id"]
            stop = asyncio.Event()

            async def start_worker_later() -> None:
                await asyncio.sleep(0.3)  # the long poll is already waiting when the worker starts
                await worker.run(stop)

            task = asyncio.create_task(start_worker_later())
            try:
                response = await http.post(
                    "/result",
                    json={"reference_id": reference_id},
                    headers={**api.headers(), "Prefer": "respond-async, wait=4"},
                )
            finally:
                stop.set()
                await asyncio.wait_for(task, 5)
        assert response.status_code == 200, response.text
        assert response.headers["Preference-Applied"] == "wait=4"
        assert response.json()["result"]["data"]["age"] == 34
        # One wait of the preferred length, ended by the result (the worker only started after it began).
        assert api.world.transactions.waits == [(reference_id, 4.0, True)]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("prefer", "applied"),
    [("wait=0", None), ("wait=abc", None), ("handling=lenient", None), ("wait=1", "wait=0.3")],
)
def test_prefer_wait_is_capped_and_unknown_preferences_are_ignored(prefer: str, applied: str | None) -> None:
    async def scenario() -> None:
        api = await build_api(wait_for_result_timeout_s=0.3)  # no worker: the transaction stays queued
        async with api.http() as http:
            reference_id = (await create_age(api, http, GREEN)).json()["result"]["data"]["reference_id"]
            response = await http.post(
                "/result", json={"reference_id": reference_id}, headers={**api.headers(), "Prefer": prefer}
            )
        assert response.status_code == 202
        assert response.json()["result"]["data"]["state"] == "queued"
        assert response.headers.get("Preference-Applied") == applied
        # An applied preference waits out its capped length; an ignored one answers without waiting.
        expected = [(reference_id, 0.3, False)] if applied is not None else []
        assert api.world.transactions.waits == expected

    asyncio.run(scenario())


async def create_search_preferring_wait(
    api: Api, http: httpx.AsyncClient, color: Color, prefer: str, **headers: str
) -> httpx.Response:
    return await http.post(
        "/face-search",
        data={"type": "face_search", "client_reference": "customer-1"},
        files=png_upload(color),
        headers={**api.headers(), "Prefer": prefer, **headers},
    )


def test_a_create_with_prefer_wait_answers_the_final_result_in_its_own_response() -> None:
    async def scenario() -> None:
        world, api, worker = await api_with_worker_for_a_34_year_old()
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            async with api.http() as http:
                search = await create_search_preferring_wait(api, http, GREEN, "wait=4")
                age = await http.post(
                    "/age-estimation",
                    data={"type": "age_estimation"},
                    files=png_upload(GREEN),
                    headers={**api.headers(), "Prefer": "wait=4"},
                )
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        assert search.status_code == 200, search.text
        assert search.headers["Preference-Applied"] == "wait=4"
        data = search.json()["result"]["data"]
        assert set(data) == {"service_reference_id", "client_reference", "face_search_response"}
        assert data["client_reference"] == "customer-1"
        assert data["face_search_response"]["result"]["is_face_found"] is True
        reference_id = data["service_reference_id"]
        assert world.transactions.peek(reference_id).state is TransactionState.COMPLETED
        assert age.status_code == 200, age.text
        assert age.headers["Preference-Applied"] == "wait=4"
        age_data = age.json()["result"]["data"]
        assert (age_data["age"], age_data["under_18"]) == (34, 0)
        # One wait each, of the preferred length, ended by the final state.
        assert world.transactions.waits == [(reference_id, 4.0, True), (age_data["reference_id"], 4.0, True)]

    asyncio.run(scenario())


def test_a_create_whose_result_is_not_ready_in_time_answers_the_create_envelope() -> None:
    async def scenario() -> None:
        api = await build_api(wait_for_result_timeout_s=0.3)  # no worker: the transaction stays queued
        async with api.http() as http:
            search = await create_search_preferring_wait(api, http, RED, "wait=10")
            plain = await http.post(
                "/face-search", data={"type": "face_search"}, files=png_upload(RED), headers=api.headers()
            )
            age = await http.post(
                "/age-estimation",
                data={"type": "age_estimation"},
                files=png_upload(RED),
                headers={**api.headers(), "Prefer": "wait=10"},
            )
        for response in (search, age):
            assert response.status_code == 200, response.text
            assert response.headers["Preference-Applied"] == "wait=0.3"  # capped by the server's bound
            assert set(response.json()["result"]["data"]) == {"reference_id"}
            assert "created" in response.json()["message"]
        assert plain.status_code == 200 and "Preference-Applied" not in plain.headers
        waited = [search, age]
        references = [response.json()["result"]["data"]["reference_id"] for response in waited]
        # The preferred waits ran out (capped); the create without the preference did not wait at all.
        assert api.world.transactions.waits == [(reference, 0.3, False) for reference in references]

    asyncio.run(scenario())


def test_prefer_wait_sets_how_long_wait_for_result_waits() -> None:
    async def scenario() -> None:
        api = await build_api(wait_for_result_timeout_s=5.0)  # no worker: the transaction stays queued
        async with api.http() as http:
            response = await http.post(
                "/age-estimation",
                data={"type": "age_estimation", "wait_for_result": "1"},
                files=png_upload(GREEN),
                headers={**api.headers(), "Prefer": "wait=1"},
            )
        # wait_for_result=1 keeps its answer for a pending result (202); the preference its length.
        assert response.status_code == 202, response.text
        assert response.headers["Preference-Applied"] == "wait=1"
        reference_id = response.json()["result"]["data"]["reference_id"]
        assert api.world.transactions.waits == [(reference_id, 1.0, False)]

    asyncio.run(scenario())


def test_a_retried_create_with_its_key_and_prefer_wait_answers_the_same_transactions_result() -> None:
    async def scenario() -> None:
        world, api, worker = await api_with_worker_for_a_34_year_old()
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        key = {"Idempotency-Key": '"retry-me-1"'}
        try:
            async with api.http() as http:
                first = await create_search_preferring_wait(api, http, GREEN, "wait=4", **key)
                again = await create_search_preferring_wait(api, http, GREEN, "wait=4", **key)
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        assert first.status_code == again.status_code == 200, again.text
        reference_id = first.json()["result"]["data"]["service_reference_id"]
        assert again.json()["result"]["data"]["service_reference_id"] == reference_id
        first_result = first.json()["result"]["data"]["face_search_response"]
        assert again.json()["result"]["data"]["face_search_response"] == first_result
        assert (await world.transactions.count_by_state())["completed"] == 1  # created once

    asyncio.run(scenario())


def test_client_secret_header_and_form_bodies_work_on_result() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            reference_id = await create_search(api, http, RED)
            response = await http.post(
                "/result", data={"reference_id": reference_id}, headers={"Client-Secret": api.client_secret}
            )
        assert response.status_code == 202
        assert response.json()["result"]["data"]["reference_id"] == reference_id

    asyncio.run(scenario())


def test_searches_never_cross_tenants() -> None:
    async def scenario() -> None:
        api = await build_api()
        other_client, _ = await api.new_client("tenant-b")
        api.world.analysis.faces_by_color[RED] = [face(embedding(1))]
        async with api.http() as http:
            mine = await create_search(api, http, RED)
            await api.world.processor().process(mine)
            response = await http.post(
                "/face-search",
                data={"type": "face_search"},
                files=png_upload(RED),
                headers=api.headers(other_client),
            )
            theirs = response.json()["result"]["data"]["reference_id"]
            await api.world.processor().process(theirs)
            answer = await result(api, http, theirs, client_id=other_client)
        assert answer.json()["result"]["data"]["face_search_response"]["result"] == {
            "matched_faces": [],
            "is_face_found": True,
        }

    asyncio.run(scenario())


def test_healthz_needs_no_credentials() -> None:
    async def scenario() -> None:
        api = await build_api()
        async with api.http() as http:
            response = await http.get("/healthz")
        assert response.status_code == 200
        assert response.json() == {"status": True}

    asyncio.run(scenario())


def test_openapi_documents_prefer_wait_on_the_creates() -> None:
    async def scenario() -> dict[str, Any]:
        api = await build_api()
        async with api.http() as http:
            return dict((await http.get("/openapi.json")).json())

    document = asyncio.run(scenario())
    schemas = document["components"]["schemas"]
    for path, result_data in (("/face-search", "FaceSearchData"), ("/age-estimation", "AgeData")):
        operation = document["paths"][path]["post"]
        prefer = [p for p in operation["parameters"] if p["in"] == "header" and p["name"] == "Prefer"]
        assert len(prefer) == 1 and "wait=" in prefer[0]["description"]
        created = operation["responses"]["200"]
        assert "Preference-Applied" in created["headers"]
        # The 200 body is the create's envelope or the result itself (or the failed-transaction envelope).
        body = created["content"]["application/json"]["schema"]
        names = {ref["$ref"].rsplit("/", 1)[1] for ref in body["anyOf"]}
        assert "FailedTransaction" in names
        envelope = next(name for name in names if name.startswith("Envelope"))
        data = schemas[envelope]["properties"]["result"]["$ref"].rsplit("/", 1)[1]
        inner = schemas[data]["properties"]["data"]["anyOf"]
        assert {ref["$ref"].rsplit("/", 1)[1] for ref in inner} == {"CreatedData", result_data}

"""Gallery management (pipelines/gallery.py and api/routes/gallery.py) over the fake stores."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import pytest

from serve_app.domain.errors import BackendUnavailable
from serve_app.domain.gallery import AuditAction
from serve_app.pipelines.gallery import GalleryService
from serve_app.pipelines.processing import enrolled_face_id
from tests.unit.fakes import (
    FakeAuditLog,
    World,
    assert_error_envelope,
    at_cosine,
    build_api,
    embedding,
    face,
)
from tests.unit.test_api import create_search, result
from tests.unit.test_processing import RED, matched, submit_search

TENANT = "tenant-a"
OTHER = "tenant-b"
KEY = b"unit-test-subject-key"


def face_id(n: int) -> str:
    return f"f{n:032x}"


def service(
    world: World, audit: FakeAuditLog | None = None, clock: Callable[[], float] = lambda: 1_800_000_000.0
) -> GalleryService:
    return GalleryService(
        world.record_store,
        world.gallery,
        world.blobs,
        audit or FakeAuditLog(),
        subject_key=KEY,
        model_version=world.policy.model_version,
        lock=world.policy.lock,
        clock=clock,
    )


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_listing_pages_by_face_id_and_survives_enrolments_between_pages() -> None:
    async def scenario() -> None:
        world = World()
        for n in range(0, 10, 2):
            await world.enrol(TENANT, face_id(n), embedding(n), f"customer-{n}")
        await world.enrol(OTHER, face_id(99), embedding(99), "customer-0")
        gallery = service(world)
        first = await gallery.list_faces(TENANT, None, None, 2)
        assert [r.face_id for r in first.faces] == [face_id(0), face_id(2)]
        # Faces enrolled meanwhile (before and after the cursor) never make a face repeat or go missing.
        await world.enrol(TENANT, face_id(1), embedding(1), "customer-1")
        await world.enrol(TENANT, face_id(5), embedding(5), "customer-5")
        seen = [r.face_id for r in first.faces]
        cursor = first.next_cursor
        while cursor is not None:
            page = await gallery.list_faces(TENANT, None, cursor, 2)
            seen += [r.face_id for r in page.faces]
            cursor = page.next_cursor
        assert seen == [face_id(n) for n in (0, 2, 4, 5, 6, 8)]
        by_reference = await gallery.list_faces(TENANT, "customer-0", None, 50)
        assert [r.face_id for r in by_reference.faces] == [face_id(0)]
        assert by_reference.next_cursor is None

    run(scenario())


def test_erasure_removes_every_face_vector_record_and_proof_of_the_reference_only() -> None:
    async def scenario() -> None:
        world = World()
        gone = [await world.enrol(TENANT, face_id(n), embedding(n), "customer-x") for n in (1, 2)]
        kept = await world.enrol(TENANT, face_id(3), embedding(3), "customer-y")
        foreign = await world.enrol(OTHER, face_id(4), embedding(4), "customer-x")
        audit = FakeAuditLog()
        gallery = service(world, audit)

        erasure = await gallery.erase_reference(TENANT, "cl_actor", "customer-x")
        assert erasure.faces_erased == 2
        assert world.gallery.face_ids(TENANT) == {kept.face_id}
        assert world.gallery.face_ids(OTHER) == {foreign.face_id}
        assert [r.face_id for r in world.record_store.records(TENANT)] == [kept.face_id]
        for record in gone:
            assert record.proof_key not in world.blobs.items
        assert kept.proof_key in world.blobs.items and foreign.proof_key in world.blobs.items
        # Idempotent: again erases nothing, and is audited too.
        assert (await gallery.erase_reference(TENANT, "cl_actor", "customer-x")).faces_erased == 0
        entries = audit.entries[TENANT]
        assert [(e.action, e.faces, e.actor) for e in entries] == [
            (AuditAction.ERASE_REFERENCE, 2, "cl_actor"),
            (AuditAction.ERASE_REFERENCE, 0, "cl_actor"),
        ]
        # The trail names the reference by a keyed hash only.
        assert "customer-x" not in repr(entries)
        assert entries[0].subject == gallery.subject_hash("reference", "customer-x")
        assert entries[0].subject != service(world).subject_hash("reference", "customer-y")

    run(scenario())


def test_a_removal_that_fails_midway_is_already_in_the_audit_trail_and_a_retry_finishes_it() -> None:
    async def scenario() -> None:
        world = World()
        for n in (1, 2):
            await world.enrol(TENANT, face_id(n), embedding(n), "customer-x")
        target = await world.enrol(TENANT, face_id(3), embedding(3), "customer-y")
        audit = FakeAuditLog()
        gallery = service(world, audit)
        healthy_delete = world.gallery.delete

        async def vector_store_down(tenant_id: str, face_ids: Any) -> None:
            raise BackendUnavailable("the vector store is unavailable")

        world.gallery.delete = vector_store_down  # type: ignore[method-assign]
        with pytest.raises(BackendUnavailable):
            await gallery.erase_reference(TENANT, "cl_actor", "customer-x")
        with pytest.raises(BackendUnavailable):
            await gallery.delete_face(TENANT, "cl_actor", target.face_id)
        # Nothing was removed, and both requests are in the trail already.
        assert world.gallery.face_ids(TENANT) == {face_id(1), face_id(2), face_id(3)}
        assert [(e.action, e.faces) for e in audit.entries[TENANT]] == [
            (AuditAction.ERASE_REFERENCE, 2),
            (AuditAction.DELETE_FACE, 1),
        ]

        world.gallery.delete = healthy_delete  # type: ignore[method-assign]
        assert (await gallery.erase_reference(TENANT, "cl_actor", "customer-x")).faces_erased == 2
        await gallery.delete_face(TENANT, "cl_actor", target.face_id)
        assert world.gallery.face_ids(TENANT) == set()
        assert [(e.action, e.faces) for e in audit.entries[TENANT]][2:] == [
            (AuditAction.ERASE_REFERENCE, 2),
            (AuditAction.DELETE_FACE, 1),
        ]

    run(scenario())


def test_an_erased_face_is_never_matched_again() -> None:
    async def scenario() -> None:
        world = World()
        await world.enrol(TENANT, face_id(1), embedding(1), "customer-x")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        before = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(before.reference_id)
        assert [m[0] for m in await matched(world, before)] == [face_id(1)]

        await service(world).erase_reference(TENANT, "cl_actor", "customer-x")
        after = await submit_search(world, RED, enroll_face=False)
        await world.processor().process(after.reference_id)
        assert await matched(world, after) == []

    run(scenario())


def test_erasure_racing_an_enrolment_of_the_reference_leaves_no_orphan() -> None:
    async def scenario() -> None:
        for erase_first in (True, False):
            world = World()
            world.analysis.faces_by_color[RED] = [face(embedding(7))]
            tx = await submit_search(world, RED, client_reference="customer-r")
            gallery = service(world)
            jobs = [
                gallery.erase_reference(TENANT, "cl_actor", "customer-r"),
                world.processor().process(tx.reference_id),
            ]
            await asyncio.gather(*(jobs if erase_first else jobs[::-1]))
            records = {r.face_id for r in world.record_store.records(TENANT)}
            # Whichever ran first, a vector exists exactly when its record does.
            assert world.gallery.face_ids(TENANT) == records
            assert world.record_store.max_lock_holders == 1

    run(scenario())


def test_a_transaction_accepted_before_an_erasure_never_enrols_the_reference_after_it() -> None:
    async def scenario() -> None:
        for allow_override in (False, True):
            world = World()
            world.analysis.faces_by_color[RED] = [face(embedding(7))]
            late = await submit_search(
                world, RED, client_reference="customer-e", allow_override=allow_override
            )
            # The erasure runs while the transaction waits in the queue (at the same instant counts too).
            await service(world, clock=functools.partial(float, late.created_at)).erase_reference(
                TENANT, "cl_actor", "customer-e"
            )
            await world.processor().process(late.reference_id)
            final = world.transactions.peek(late.reference_id)
            assert final.result is not None and final.result.enrolled is False
            assert world.record_store.for_reference(TENANT, "customer-e") == []
            assert world.gallery.face_ids(TENANT) == set()
            assert late.image_key not in world.blobs.items  # nothing refers to the upload any more
            # A transaction accepted after the erasure enrols the reference again.
            fresh = await submit_search(world, RED, client_reference="customer-e")
            await world.processor().process(fresh.reference_id)
            assert [r.face_id for r in world.record_store.for_reference(TENANT, "customer-e")] == [
                enrolled_face_id(fresh.reference_id)
            ]

    run(scenario())


def test_results_read_after_an_erasure_no_longer_name_the_reference_or_its_proof() -> None:
    """Stored results keep face ids; references are joined when read, so an erasure reaches results
    finished before it: the match goes (with its proof URL), and the searcher's own client_reference
    reads as "" once that reference is erased."""

    async def scenario() -> None:
        world = World()
        api = await build_api(world)
        gallery = service(world, clock=lambda: 1_800_000_000.0)
        api.services = _with_gallery(api.services, gallery)
        erased = await world.enrol(api.client_id, face_id(1), embedding(1), "customer-x")
        kept = await world.enrol(api.client_id, face_id(2), at_cosine(embedding(1), 0.9), "customer-y")
        world.analysis.faces_by_color[RED] = [face(embedding(1))]
        async with api.http() as http:
            reference_id = await create_search(api, http, RED, client_reference="customer-own")
            await world.processor().process(reference_id)

            async def read() -> dict[str, Any]:
                response = await result(api, http, reference_id)
                assert response.status_code == 200, response.text
                data: dict[str, Any] = response.json()["result"]["data"]
                return data

            before = await read()
            assert before["client_reference"] == "customer-own"
            matches = before["face_search_response"]["result"]["matched_faces"]
            assert [(m[0], m[3]) for m in matches] == [
                (erased.face_id, "customer-x"),
                (kept.face_id, "customer-y"),
            ]
            proof_path = matches[0][2].removeprefix("http://testserver")
            assert (await http.get(proof_path)).status_code == 200

            await gallery.erase_reference(api.client_id, "cl_actor", "customer-x")
            after = await read()
            matches = after["face_search_response"]["result"]["matched_faces"]
            assert [(m[0], m[3]) for m in matches] == [(kept.face_id, "customer-y")]
            assert "customer-x" not in repr(after)
            assert (await http.get(proof_path)).status_code == 404
            assert after["client_reference"] == "customer-own"

            await gallery.erase_reference(api.client_id, "cl_actor", "customer-own")
            own_erased = await read()
            assert own_erased["client_reference"] == ""
            assert "customer-own" not in repr(own_erased)

    run(scenario())


def test_delete_face_removes_it_and_is_tenant_scoped() -> None:
    async def scenario() -> None:
        world = World()
        record = await world.enrol(TENANT, face_id(1), embedding(1), "customer-x")
        audit = FakeAuditLog()
        gallery = service(world, audit)
        api = await build_api(world)
        api.services = _with_gallery(api.services, gallery)
        other_id, _ = await api.new_client("tenant-b")
        async with api.http() as http:
            foreign = await http.delete(f"/gallery/faces/{record.face_id}", headers=api.headers(other_id))
            assert foreign.status_code == 404
            assert_error_envelope(foreign.json())
            assert world.gallery.face_ids(TENANT) == {record.face_id}
        # The face belongs to TENANT, which is the api's own client only through build_api: re-enrol there.
        record = await world.enrol(api.client_id, face_id(2), embedding(2), "customer-x")
        async with api.http() as http:
            ok = await http.delete(f"/gallery/faces/{record.face_id}", headers=api.headers())
            assert ok.status_code == 200, ok.text
            assert ok.json()["result"]["data"] == {"face_id": record.face_id, "deleted": True}
            again = await http.delete(f"/gallery/faces/{record.face_id}", headers=api.headers())
            assert again.status_code == 404
        assert world.gallery.face_ids(api.client_id) == set()
        assert record.proof_key not in world.blobs.items
        assert [e.action for e in audit.entries[api.client_id]] == [AuditAction.DELETE_FACE]

    run(scenario())


def _with_gallery(services: Any, gallery: GalleryService) -> Any:
    import dataclasses

    return dataclasses.replace(services, gallery=gallery)


def test_http_contract_and_bad_input() -> None:
    async def scenario() -> None:
        world = World()
        api = await build_api(world)
        audit = FakeAuditLog()
        api.services = _with_gallery(api.services, service(world, audit))
        for n in range(3):
            await world.enrol(api.client_id, face_id(n), embedding(n), "customer-a" if n < 2 else None)
        async with api.http() as http:
            unauthenticated = await http.get("/gallery/faces")
            assert unauthenticated.status_code == 401
            assert_error_envelope(unauthenticated.json())

            page = await http.get("/gallery/faces", params={"limit": "2"}, headers=api.headers())
            assert page.status_code == 200, page.text
            data = page.json()["result"]["data"]
            assert [f["face_id"] for f in data["faces"]] == [face_id(0), face_id(1)]
            first = data["faces"][0]
            assert first["client_reference"] == "customer-a"
            assert first["enrolled_at"].endswith("Z") and first["model_version"]
            proof = await http.get(first["proof_url"].removeprefix("http://testserver"))
            assert proof.status_code == 200 and proof.content == b"proof-bytes"
            rest = await http.get(
                "/gallery/faces", params={"limit": "2", "cursor": data["next_cursor"]}, headers=api.headers()
            )
            rest_data = rest.json()["result"]["data"]
            assert [f["client_reference"] for f in rest_data["faces"]] == [""]
            assert rest_data["next_cursor"] is None

            stats = await http.get("/gallery/stats", headers=api.headers())
            assert stats.json()["result"]["data"]["faces"] == 3
            assert stats.json()["result"]["data"]["client_references"] == 1

            erased = await http.post(
                "/gallery/erasures", json={"client_reference": "customer-a"}, headers=api.headers()
            )
            assert erased.status_code == 200, erased.text
            assert erased.json()["result"]["data"]["faces_erased"] == 2
            proof_after = await http.get(first["proof_url"].removeprefix("http://testserver"))
            assert proof_after.status_code == 404
            audit_page = await http.get("/gallery/audit", headers=api.headers())
            entries = audit_page.json()["result"]["data"]["entries"]
            assert [(e["action"], e["faces"], e["actor"]) for e in entries] == [
                ("erase_reference", 2, api.client_id)
            ]

            bad = [
                http.get("/gallery/faces", params={"limit": "0"}, headers=api.headers()),
                http.get("/gallery/faces", params={"limit": "201"}, headers=api.headers()),
                http.get("/gallery/faces", params={"limit": "ten"}, headers=api.headers()),
                http.get("/gallery/faces", params={"limit": "007"}, headers=api.headers()),
                http.get("/gallery/faces", params={"cursor": "not-a-cursor"}, headers=api.headers()),
                http.get("/gallery/faces", params={"client_reference": "abc"}, headers=api.headers()),
                http.get("/gallery/audit", params={"cursor": data["next_cursor"]}, headers=api.headers()),
                http.delete("/gallery/faces/nope", headers=api.headers()),
                http.post("/gallery/erasures", json={"client_reference": "x"}, headers=api.headers()),
                http.post("/gallery/erasures", json={}, headers=api.headers()),
                http.post("/gallery/erasures", json={"client_reference": "bad\nline"}, headers=api.headers()),
            ]
            for response in await asyncio.gather(*bad):
                assert response.status_code == 422, (response.request.url, response.text)
                assert_error_envelope(response.json())
            not_json = await http.post("/gallery/erasures", content=b"x", headers=api.headers())
            assert not_json.status_code == 415

    run(scenario())


def test_openapi_documents_the_extension() -> None:
    async def scenario() -> None:
        world = World()
        api = await build_api(world)
        api.services = _with_gallery(api.services, service(world))
        async with api.http() as http:
            document = (await http.get("/openapi.json")).json()
        paths = document["paths"]
        for path, method in (
            ("/gallery/faces", "get"),
            ("/gallery/faces/{face_id}", "delete"),
            ("/gallery/erasures", "post"),
            ("/gallery/stats", "get"),
            ("/gallery/audit", "get"),
        ):
            operation = paths[path][method]
            assert operation["tags"] == ["gallery (extension)"]
            assert "200" in operation["responses"] and "422" in operation["responses"]

    run(scenario())


def test_enrolled_face_id_has_the_listed_format() -> None:
    from serve_app.domain.identifiers import is_face_id

    assert is_face_id(enrolled_face_id("0" * 32))
    assert not is_face_id("f" + "0" * 31)

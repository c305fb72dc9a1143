"""Gallery management (extension) end to end: the real service, real photos, real Redis and Milvus."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.faces_dev import FacesDev
from tests.integration.api_client import auth, face_search_json, reference_of, wait_result
from tests.service_harness import RunningService

pytestmark = pytest.mark.service


def matched_ids(http: httpx.Client, token: str, path: Any) -> list[str]:
    reference_id = reference_of(face_search_json(http, token, path, enroll_face=False))
    data = wait_result(http, token, reference_id)["result"]["data"]
    return [match[0] for match in data["face_search_response"]["result"]["matched_faces"]]


def enrol(http: httpx.Client, token: str, path: Any, reference: str) -> str:
    reference_id = reference_of(face_search_json(http, token, path, client_reference=reference))
    wait_result(http, token, reference_id)
    return f"f{reference_id}"


def data_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] is True
    data: dict[str, Any] = body["result"]["data"]
    return data


def test_erased_and_deleted_faces_are_gone_for_good(service: RunningService, faces_dev: FacesDev) -> None:
    token = service.token_for(service.new_client("gallery-tests"))
    identities = list(faces_dev.by_identity().values())
    erased_photos, deleted_photos = identities[0], identities[1]
    reference = f"erase-me-{uuid.uuid4().hex[:8]}"
    with service.http() as http:
        erased_face = enrol(http, token, erased_photos[0].path, reference)
        deleted_face = enrol(http, token, deleted_photos[0].path, f"keep-{uuid.uuid4().hex[:8]}")
        assert erased_face in matched_ids(http, token, erased_photos[1].path)
        assert deleted_face in matched_ids(http, token, deleted_photos[1].path)

        listed = data_of(
            http.get("/gallery/faces", params={"client_reference": reference}, headers=auth(token))
        )
        assert [face["face_id"] for face in listed["faces"]] == [erased_face]
        proof_url = listed["faces"][0]["proof_url"]
        assert httpx.get(proof_url).status_code == 200
        stats = data_of(http.get("/gallery/stats", headers=auth(token)))
        assert (stats["faces"], stats["client_references"]) == (2, 2)

        erasure = data_of(
            http.post("/gallery/erasures", json={"client_reference": reference}, headers=auth(token))
        )
        assert erasure["faces_erased"] == 1
        assert erased_face not in matched_ids(http, token, erased_photos[1].path)
        everything = data_of(http.get("/gallery/faces", headers=auth(token)))
        assert [face["face_id"] for face in everything["faces"]] == [deleted_face]
        assert httpx.get(proof_url).status_code == 404
        again = data_of(
            http.post("/gallery/erasures", json={"client_reference": reference}, headers=auth(token))
        )
        assert again["faces_erased"] == 0

        deleted = data_of(http.delete(f"/gallery/faces/{deleted_face}", headers=auth(token)))
        assert deleted == {"face_id": deleted_face, "deleted": True}
        assert deleted_face not in matched_ids(http, token, deleted_photos[1].path)
        assert http.delete(f"/gallery/faces/{deleted_face}", headers=auth(token)).status_code == 404
        assert data_of(http.get("/gallery/stats", headers=auth(token)))["faces"] == 0

        entries = data_of(http.get("/gallery/audit", headers=auth(token)))["entries"]
        assert [(entry["action"], entry["faces"]) for entry in entries] == [
            ("delete_face", 1),
            ("erase_reference", 0),
            ("erase_reference", 1),
        ]
        assert all(reference not in str(entry) and deleted_face not in str(entry) for entry in entries)

        # Another tenant sees none of it and cannot delete it.
        other = service.token_for(service.new_client("gallery-other"))
        assert data_of(http.get("/gallery/faces", headers=auth(other)))["faces"] == []
        bad = http.get("/gallery/faces", params={"cursor": "garbage"}, headers=auth(token))
        assert bad.status_code == 422 and bad.json()["status"] is False

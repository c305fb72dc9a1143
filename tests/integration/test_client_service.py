"""facesearch_client against the real service: login, Client-Secret mode, long polling, typed results,
gallery management, sync and async."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from facesearch_client import (
    AgeResult,
    ApiError,
    AsyncFaceSearchClient,
    AuthenticationError,
    FaceSearchClient,
    FaceSearchResult,
)
from tests.faces_dev import FacesDev
from tests.service_harness import RunningService

pytestmark = pytest.mark.service


def test_sync_client_end_to_end(service: RunningService, faces_dev: FacesDev) -> None:
    credentials = service.new_client("client-lib")
    photos = next(iter(faces_dev.by_identity().values()))
    reference = f"lib-{uuid.uuid4().hex[:8]}"
    with FaceSearchClient(service.base_url, credentials.client_id, credentials.client_secret) as client:
        enrolled = client.search(photos[0].path, client_reference=reference)
        assert enrolled.is_face_found and enrolled.client_reference == reference
        found = client.search(photos[1].path, enroll_face=False, as_json=True)
        assert isinstance(found, FaceSearchResult)
        assert found.matches[0].client_reference == reference
        assert found.matches[0].face_id == f"f{enrolled.reference_id}"
        assert client.proof(found.matches[0].proof_url)[:2] in (b"\xff\xd8", b"\x89P")

        age_photo = faces_dev.of_kind("age")[0]
        age = client.age_estimation(age_photo.path, enroll_face=False)
        assert isinstance(age, AgeResult) and age.age is not None

        faces = list(client.iter_faces(page_size=1))
        assert [face.client_reference for face in faces] == [reference]
        assert client.gallery_stats().faces == 1
        assert client.erase(reference).faces_erased == 1
        assert client.search(photos[1].path, enroll_face=False).matches == []
        assert client.audit().entries[0].action == "erase_reference"
        with pytest.raises(ApiError) as raised:
            client.erase("abc")
        assert raised.value.status_code == 422 and "client_reference" in raised.value.errors

    # The Client-Secret mode: no login at all.
    with FaceSearchClient(service.base_url, client_secret=credentials.client_secret, mode="secret") as secret:
        assert secret.gallery_stats().faces == 0
    with (
        FaceSearchClient(service.base_url, credentials.client_id, "wrong-secret") as wrong,
        pytest.raises(AuthenticationError),
    ):
        wrong.gallery_stats()


def test_async_client_end_to_end(service: RunningService, faces_dev: FacesDev) -> None:
    credentials = service.new_client("client-lib-async")
    photos = next(iter(faces_dev.by_identity().values()))

    async def scenario() -> None:
        async with AsyncFaceSearchClient(
            service.base_url, credentials.client_id, credentials.client_secret
        ) as client:
            references = await asyncio.gather(
                *(
                    client.submit_face_search(photo.path, client_reference=f"async-{n:03d}")
                    for n, photo in enumerate(photos[:2])
                )
            )
            results = await asyncio.gather(*(client.wait(reference) for reference in references))
            assert all(isinstance(result, FaceSearchResult) and result.is_face_found for result in results)
            page = await client.list_faces(limit=200)
            assert sorted(face.client_reference for face in page.faces) == ["async-000", "async-001"]

    asyncio.run(scenario())

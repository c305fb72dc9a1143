"""Issue 9/11: a tenant's --min-score / --max-matches (`facesearch clients update`) take effect on the
running service, without a restart, once the workers' short per-tenant cache expires."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from serve_app.launch.cli import _clients
from serve_app.pipelines.processing import ProcessingPolicy
from tests.faces_dev import FacesDev
from tests.integration.api_client import face_search_json, reference_of, wait_result
from tests.service_harness import RunningService

pytestmark = pytest.mark.service

# Workers re-read a tenant's settings at most this often (ProcessingPolicy.tenant_cache_s).
CACHE_S = float(ProcessingPolicy.__dataclass_fields__["tenant_cache_s"].default)  # type: ignore[arg-type]


def matches(http: httpx.Client, token: str, path: Path) -> list[list[object]]:
    reference_id = reference_of(face_search_json(http, token, path, enroll_face=False))
    data = wait_result(http, token, reference_id)["result"]["data"]
    found: list[list[object]] = data["face_search_response"]["result"]["matched_faces"]
    return found


def update(service: RunningService, client_id: str, min_score: str | None, max_matches: str | None) -> None:
    assert asyncio.run(_clients(service.settings, "update", client_id, min_score, max_matches)) == 0
    time.sleep(CACHE_S + 1)  # let the cached settings expire; no restart in between


def test_clients_update_applies_without_restart(service: RunningService, faces_dev: FacesDev) -> None:
    client = service.new_client("settings")
    token = service.token_for(client)
    groups = [photos for photos in faces_dev.by_identity().values() if len(photos) >= 3]
    photos, stranger = groups[0], groups[1][0]
    with service.http() as http:
        for photo in (photos[0], photos[2]):
            reference = f"s-{uuid.uuid4().hex[:6]}"
            wait_result(
                http,
                token,
                reference_of(face_search_json(http, token, photo.path, client_reference=reference)),
            )
        default = matches(http, token, photos[1].path)
        assert len(default) == 2
        assert matches(http, token, stranger.path) == []  # another person: under the calibrated bar

        update(service, client.client_id, None, "1")
        assert [match[0] for match in matches(http, token, photos[1].path)] == [default[0][0]]

        # The lowest bar lets every enrolled face through, even another person's.
        update(service, client.client_id, "0", "default")
        assert len(matches(http, token, stranger.path)) == 2

        update(service, client.client_id, "default", "default")
        assert matches(http, token, stranger.path) == []
        assert len(matches(http, token, photos[1].path)) == 2

"""End to end (issue 35, item 1): the whole service with WAIT 1 on its embedded Redis, which has no replica
at first, so every create falls short of its replica and is answered 503 although Redis wrote it and a
worker processes it. The Python client retries with the one Idempotency-Key it made for the request; once a
replica is attached, a retry is answered with the first attempt's reference_id. Exactly one transaction
exists and exactly one face is enrolled under the client_reference. (The lost reply and the failed wait
are in tests/integration/test_idempotent_create.py, on the ingress alone.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from facesearch_client import FaceSearchClient, FaceSearchResult, calls
from facesearch_client._policy import RetryPolicy
from serve_app.stores.redis_support import connect_redis
from serve_app.wiring.stores import redis_stores
from tests.faces_dev import FacesDev
from tests.integration.test_idempotent_create import replica_of
from tests.service_harness import RunningService, running_service

FINISH_TIMEOUT_S = 300.0  # hang guard only


@pytest.fixture(scope="module")
def short_of_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    env = {"FACESEARCH_REDIS_WAIT_REPLICAS": "1", "FACESEARCH_REDIS_WAIT_TIMEOUT_MS": "200"}
    with running_service(tmp_path_factory.mktemp("idempotent-e2e"), env=env) as service:
        yield service


def test_a_create_retried_through_a_replica_shortfall_enrols_one_face(
    short_of_replicas: RunningService, faces_dev: FacesDev, tmp_path: Path
) -> None:
    service = short_of_replicas
    owner = service.new_client("idempotent-e2e")
    photo = faces_dev.by_identity()[sorted(faces_dev.by_identity())[0]][0].path
    retry = RetryPolicy(max_retries=2, base_s=0.0, max_wait_s=0.0)
    with FaceSearchClient(service.base_url, owner.client_id, owner.client_secret, retry=retry) as client:
        call = calls.face_search(photo, client_reference="subject-e2e")
        short = client.send(call)  # the first try and two retries, each short of the replica
        assert short.status_code == 503, short.text
        assert service.embedded.redis is not None
        with replica_of(service.embedded.redis, tmp_path / "replica"):
            answered = client.send(call)
        assert answered.status_code == 200, answered.text
        reference_id = answered.json()["result"]["data"]["reference_id"]
        result = client.wait(reference_id, FINISH_TIMEOUT_S)
        assert isinstance(result, FaceSearchResult) and result.is_face_found
        faces = list(client.iter_faces("subject-e2e"))
    assert len(faces) == 1

    async def transactions() -> int:
        redis = connect_redis(str(service.settings.redis.url))
        try:
            return sum((await redis_stores(service.settings, redis).transactions.count_by_state()).values())
        finally:
            await redis.aclose()

    assert asyncio.run(transactions()) == 1

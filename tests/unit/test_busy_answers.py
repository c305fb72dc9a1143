"""Failures behind the service that pass (a full disk, a full Redis, a model down) answer like a busy server:
their status, a Retry-After, the envelope with a fixed message, nothing created; the client retries them.
The real file system and the real redis-server run the same in tests/integration/test_full_backends.py."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path

import httpx
import pytest
from redis import exceptions as redis_exceptions

from facesearch_client import RetriesExhausted, RetryPolicy
from serve_app.domain.errors import (
    BackendRejected,
    BackendUnavailable,
    ModelUnavailable,
    ServiceError,
    StorageFull,
)
from serve_app.stores import blobs
from serve_app.stores.blobs import LocalBlobStore
from serve_app.stores.redis_support import to_backend_unavailable
from tests.unit.fakes import build_api, solid_png
from tests.unit.test_client import Service, client, envelope, error


@pytest.mark.parametrize(
    ("failure", "status", "retry_after"),
    [
        (StorageFull("blob store /srv/blobs: No space left on device"), 507, "30"),
        (BackendUnavailable("Redis is unavailable: OutOfMemoryError: OOM command not allowed"), 503, "5"),
        (ModelUnavailable("the detector deployment did not answer"), 503, "5"),
    ],
)
def test_an_upload_the_service_cannot_take_now_answers_its_status_with_retry_after_and_creates_nothing(
    failure: ServiceError, status: int, retry_after: str
) -> None:
    async def scenario() -> None:
        api = await build_api()
        api.world.faults.arm("blobs.put", error=failure)
        async with api.http() as http:
            response = await http.post(
                "/face-search",
                data={"type": "face_search"},
                files={"file": ("a.png", solid_png((9, 9, 9)), "image/png")},
                headers=api.headers(),
            )
        assert response.status_code == status, response.text
        assert response.headers["Retry-After"] == retry_after
        assert response.json() == {"status": False, "message": type(failure).public_message, "errors": {}}
        assert (await api.world.transactions.count_by_state())["queued"] == 0

    asyncio.run(scenario())


def test_a_blob_write_refused_for_quota_is_storage_full_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EDQUOT as ENOSPC (which the integration test meets on a real full tmpfs); the content type is written
    first, so its file must go when the data cannot follow. Other I/O errors stay what they are (a 500)."""
    store = LocalBlobStore(tmp_path)
    written = blobs._atomic_write
    refusal = OSError(errno.EDQUOT, "Disk quota exceeded")

    def refuse_data(path: Path, data: bytes) -> None:
        if path.suffix != ".type":
            raise refusal
        written(path, data)

    monkeypatch.setattr(blobs, "_atomic_write", refuse_data)
    with pytest.raises(StorageFull):
        asyncio.run(store.put("uploads/t/r1", b"image", "image/png"))
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []

    refusal = OSError(errno.EIO, "Input/output error")
    with pytest.raises(OSError) as raised:
        asyncio.run(store.put("uploads/t/r2", b"image", "image/png"))
    assert not isinstance(raised.value, StorageFull) and raised.value.errno == errno.EIO


@pytest.mark.parametrize(
    "reply",
    [
        redis_exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        redis_exceptions.ResponseError(
            "Error running script (call to f_0): @user_script:16: @user_script: 16: -OOM command not allowed "
            "when used memory > 'maxmemory'."
        ),
        redis_exceptions.ResponseError("MISCONF Errors writing to the AOF file: No space left on device"),
    ],
)
def test_a_redis_that_refuses_writes_for_now_is_an_outage_logged_without_a_traceback(
    reply: redis_exceptions.RedisError, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    translated = to_backend_unavailable(reply)
    assert type(translated) is BackendUnavailable  # requeued by a worker, never a failed attempt
    assert not caplog.records


def test_a_reply_that_would_come_every_time_is_rejected_and_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    translated = to_backend_unavailable(redis_exceptions.ResponseError("WRONGTYPE Operation against a key"))
    assert type(translated) is BackendRejected
    assert [record.levelno for record in caplog.records] == [logging.ERROR]


def test_the_client_retries_a_507_after_its_retry_after_and_then_reports_it() -> None:
    service = Service()
    api, slept = client(service, retry=RetryPolicy(max_retries=2, max_wait_s=60))
    full = httpx.Response(507, json=error("full"), headers={"Retry-After": "30"})
    service.queue("/face-search", full, httpx.Response(200, json=envelope({"reference_id": "0" * 32})))
    assert api.submit_face_search(solid_png((1, 2, 3))) == "0" * 32
    assert slept == [30.0]
    sent = service.sent("/face-search")
    assert sent[0].headers["idempotency-key"] == sent[1].headers["idempotency-key"]

    service.queue("/face-search", full, full, full)
    with pytest.raises(RetriesExhausted) as raised:
        api.submit_face_search(solid_png((1, 2, 3)))
    assert raised.value.status_code == 507

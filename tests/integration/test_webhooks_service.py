"""Completion webhooks through the running service (Ray Serve, its worker's delivery loop, embedded Redis
and milvus-lite, real models): a client registers its endpoint, runs face searches, and receives a signed
event per transaction that verify_webhook accepts, carrying what /result answers."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from facesearch_client import verify_webhook
from tests.faces_dev import FacesDev
from tests.integration.api_client import face_search_multipart, reference_of, wait_result
from tests.service_harness import RunningService

pytestmark = pytest.mark.service


class _Inbox(BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        self.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def inbox() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    received: list[tuple[dict[str, str], bytes]] = []
    handler = type("Inbox", (_Inbox,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/facesearch-events", received
    finally:
        server.shutdown()
        server.server_close()


def test_a_face_search_is_pushed_signed_to_the_registered_webhook(
    service: RunningService, faces_dev: FacesDev, inbox: tuple[str, list[tuple[dict[str, str], bytes]]]
) -> None:
    url, received = inbox
    client = service.new_client("webhooks-e2e")
    token = service.token_for(client)
    photos = next(iter(faces_dev.by_identity().values()))
    reference = f"hook-{uuid.uuid4().hex[:8]}"
    with service.http(timeout=120) as http:
        headers = {"Authorization": f"Bearer {token}"}
        registered = http.put("/webhook", json={"url": url}, headers=headers)
        assert registered.status_code == 200, registered.text
        secret = registered.json()["result"]["data"]["secret"]
        enrolled = reference_of(
            face_search_multipart(http, token, photos[0].path, client_reference=reference)
        )
        answers = {enrolled: wait_result(http, token, enrolled)}  # enrolled before the search looks
        searched = reference_of(face_search_multipart(http, token, photos[1].path, enroll_face="0"))
        answers[searched] = wait_result(http, token, searched)

        deadline = time.monotonic() + 120  # hang guard: delivery follows the final state within a poll
        while len({h["webhook-id"] for h, _ in received}) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        events = {}
        for item_headers, body in received:
            event = verify_webhook(secret, item_headers, body)
            events[event["data"]["reference_id"]] = event
        assert set(events) == {enrolled, searched}
        for ref, event in events.items():
            assert event["id"] == f"evt_{ref}" and event["type"] == "transaction.completed"
            assert event["data"]["transaction_type"] == "face_search"
            pushed, polled = event["data"]["result"], answers[ref]
            # What /result answers, but for the proof URLs' tokens (each rendering mints fresh ones).
            assert _without_proof_tokens(pushed) == _without_proof_tokens(polled)
        assert events[enrolled]["data"]["client_reference"] == reference
        matches = events[searched]["data"]["result"]["result"]["data"]["face_search_response"]["result"]
        assert matches["matched_faces"][0][3] == reference

        log = http.get("/webhook/deliveries", headers=headers).json()["result"]["data"]["deliveries"]
        assert {(d["reference_id"], d["outcome"], d["status_code"]) for d in log} >= {
            (enrolled, "delivered", 200),
            (searched, "delivered", 200),
        }
        # The series the dashboard's webhook panels read.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            scraped = httpx.get(service.metrics_url, timeout=10).text
            if "ray_facesearch_webhook_events{" in scraped and 'outcome="delivered"' in scraped:
                break
            time.sleep(1)
        assert "ray_facesearch_webhook_queue_age_seconds" in scraped


def _without_proof_tokens(body: dict[str, Any]) -> str:
    """The body with every proof URL replaced (the worker renders them on FACESEARCH_PUBLIC_BASE_URL, or
    as paths when it is unset; /result on the request's address)."""
    return re.sub(r'"[^"]*/get-proof/[^"]*"', '"<proof>"', json.dumps(body, sort_keys=True))

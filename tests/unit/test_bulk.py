"""facesearch_client.bulk against a scripted service (httpx.MockTransport): which rows are sent, what the
state file and the failures CSV say, and what a second run skips."""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from facesearch_client import AsyncFaceSearchClient, bulk
from facesearch_client._policy import RetryPolicy
from serve_app.launch.cli import main


def envelope(data: dict[str, Any]) -> dict[str, Any]:
    return {"status": True, "message": "ok", "result": {"data": data}}


class Service:
    """Enrols every upload except those whose bytes say NOFACE (no face) or BAD (415)."""

    def __init__(self) -> None:
        self.uploads: list[bytes] = []
        self.erased: list[str] = []
        self.results: dict[str, bool] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/face-search":
            self.uploads.append(request.content)
            if b"BAD" in request.content:
                body = {"status": False, "message": "not an image", "errors": {"file": "type"}}
                return httpx.Response(415, json=body)
            reference_id = f"{len(self.uploads):032x}"
            self.results[reference_id] = b"NOFACE" not in request.content
            return httpx.Response(200, json=envelope({"reference_id": reference_id}))
        if path == "/result":
            reference_id = json.loads(request.content)["reference_id"]
            found = self.results[reference_id]
            data = {
                "service_reference_id": reference_id,
                "client_reference": "x",
                "face_search_response": {"result": {"matched_faces": [], "is_face_found": found}},
            }
            return httpx.Response(200, json=envelope(data))
        if path == "/gallery/erasures":
            reference = json.loads(request.content)["client_reference"]
            self.erased.append(reference)
            data = {"client_reference": reference, "faces_erased": 1, "erased_at": "2026-11-23T19:00:00Z"}
            return httpx.Response(200, json=envelope(data))
        raise AssertionError(path)


def client(service: Service) -> AsyncFaceSearchClient:
    http = httpx.AsyncClient(base_url="http://service", transport=httpx.MockTransport(service))
    return AsyncFaceSearchClient(client_secret="s", mode="secret", http=http)


def test_folder_rows_use_the_file_name_stem(tmp_path: Path) -> None:
    for name in ("b-0002.JPG", "a-0001.png", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    rows = bulk.enrolment_rows(tmp_path)
    assert [(row.client_reference, row.path.name if row.path else None) for row in rows] == [
        ("a-0001", "a-0001.png"),
        ("b-0002", "b-0002.JPG"),
    ]


def test_enrolment_records_failures_and_a_second_run_skips_what_is_done(tmp_path: Path) -> None:
    photos = {
        "good-1": b"\xff\xd8 ok 1",
        "noface": b"\xff\xd8 NOFACE",
        "bad": b"BAD",
        "good-2": b"\xff\xd8 ok 2",
    }
    for name, content in photos.items():
        (tmp_path / f"{name}.jpg").write_bytes(content)
    source = tmp_path / "gallery.csv"
    with source.open("w", newline="") as handle:
        csv.writer(handle).writerows(
            [("path", "client_reference"), *((f"{n}.jpg", f"ref-{n}") for n in photos)]
        )
    state, failures = tmp_path / "state.jsonl", tmp_path / "failures.csv"
    service = Service()

    async def run() -> bulk.Summary:
        async with client(service) as api:
            rows = bulk.enrolment_rows(source)
            return await bulk.enroll(api, rows, state, failures, concurrency=2, progress=False)

    first = asyncio.run(run())
    assert (first.total, first.done, first.skipped, first.failed) == (4, 2, 0, 2)
    with failures.open() as handle:
        reasons = {line["client_reference"]: line["reason"] for line in csv.DictReader(handle)}
    assert reasons["ref-noface"] == "no face found in the image"
    assert reasons["ref-bad"].startswith("HTTP 415")
    second = asyncio.run(run())
    assert (second.done, second.skipped, second.failed) == (0, 2, 2)
    # Only the two failed rows were sent again.
    assert len(service.uploads) == 4 + 2


def test_cli_erase_from_a_list_and_bad_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    listing = tmp_path / "leavers.txt"
    listing.write_text("customer-1\n\ncustomer-2\n")
    assert [row.client_reference for row in bulk.erasure_rows(listing)] == ["customer-1", "customer-2"]
    as_csv = tmp_path / "leavers.csv"
    as_csv.write_text("client_reference,note\ncustomer-3,left\n")
    assert [row.client_reference for row in bulk.erasure_rows(as_csv)] == ["customer-3"]

    monkeypatch.delenv("FACESEARCH_CLIENT_SECRET", raising=False)
    assert main(["erase", str(listing)]) == 2  # no credentials
    assert main(["erase", str(listing), "--client-secret", "s", "--concurrency", "0"]) == 2
    assert main(["enroll", str(tmp_path / "missing.csv"), "--client-secret", "s"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_state_file_cut_mid_line_loses_no_entry_written_after_it(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    path.write_text(json.dumps({"key": "a", "status": "done"}) + "\n" + '{"key": "cut sh')
    state = bulk.StateFile(path)
    state.record("b", "done")
    state.close()
    reread = bulk.StateFile(path)
    reread.close()
    assert {key: entry["status"] for key, entry in reread.latest.items()} == {"a": "done", "b": "done"}


class KeyedService(Service):
    """Creates at most one transaction per Idempotency-Key (as the service does) and, while `outage` is
    set, loses every answer to a create after making it (a 503, as after a WAIT shortfall)."""

    def __init__(self) -> None:
        super().__init__()
        self.outage = True
        self.keys: list[str] = []
        self.created: dict[str, str] = {}  # key -> reference_id

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/face-search":
            return super().__call__(request)
        key = request.headers["Idempotency-Key"]
        self.keys.append(key)
        if key not in self.created:
            answer = super().__call__(request)
            self.created[key] = answer.json()["result"]["data"]["reference_id"]
        if self.outage:
            body = {"status": False, "message": "unavailable", "errors": {}}
            return httpx.Response(503, json=body, headers={"Retry-After": "0"})
        return httpx.Response(200, json=envelope({"reference_id": self.created[key]}))


def test_a_row_whose_submission_went_unanswered_is_sent_again_with_its_key(tmp_path: Path) -> None:
    (tmp_path / "subject.jpg").write_bytes(b"\xff\xd8 ok")
    state, failures = tmp_path / "state.jsonl", tmp_path / "failures.csv"
    service = KeyedService()

    async def run() -> bulk.Summary:
        http = httpx.AsyncClient(base_url="http://service", transport=httpx.MockTransport(service))
        retry = RetryPolicy(max_retries=2, base_s=0.0, max_wait_s=0.0)
        async with AsyncFaceSearchClient(client_secret="s", mode="secret", http=http, retry=retry) as api:
            rows = bulk.enrolment_rows(tmp_path)
            return await bulk.enroll(api, rows, state, failures, concurrency=1, progress=False)

    first = asyncio.run(run())
    assert first.failed == 1 and len(service.keys) == 3  # the first try and two retries
    service.outage = False
    second = asyncio.run(run())
    assert second.done == 1
    # One key for every attempt of both runs, so one transaction: the one the second run waited for.
    assert len(set(service.keys)) == 1 and len(service.keys) == 4
    assert len(service.created) == 1 and len(service.uploads) == 1
    done = json.loads(state.read_text().splitlines()[-1])
    assert done["status"] == "done" and done["reference_id"] == next(iter(service.created.values()))


class OneRequestService(Service):
    """Answers a create that carries `Prefer: wait` with its result, as the service does when it is final in
    time; counts the /result polls."""

    def __init__(self) -> None:
        super().__init__()
        self.polls = 0
        self.preferences: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/result":
            self.polls += 1
        answer = super().__call__(request)
        if request.url.path != "/face-search" or answer.status_code != 200:
            return answer
        self.preferences.append(request.headers.get("prefer", ""))
        reference_id = answer.json()["result"]["data"]["reference_id"]
        data = {
            "service_reference_id": reference_id,
            "client_reference": "x",
            "face_search_response": {"result": {"matched_faces": [], "is_face_found": True}},
        }
        return httpx.Response(200, json=envelope(data), headers={"Preference-Applied": "wait=10"})


def test_each_row_is_one_request_when_its_result_is_ready_in_time(tmp_path: Path) -> None:
    for name in ("a-0001", "b-0002"):
        (tmp_path / f"{name}.jpg").write_bytes(b"\xff\xd8 " + name.encode())
    state, failures = tmp_path / "state.jsonl", tmp_path / "failures.csv"
    service = OneRequestService()

    async def run() -> bulk.Summary:
        async with client(service) as api:
            return await bulk.enroll(api, bulk.enrolment_rows(tmp_path), state, failures, progress=False)

    summary = asyncio.run(run())
    assert (summary.done, summary.failed) == (2, 0)
    assert service.preferences == ["wait=10", "wait=10"] and service.polls == 0
    entries = [json.loads(line) for line in state.read_text().splitlines()]
    done = {entry["reference_id"] for entry in entries if entry["status"] == "done"}
    submitted = {entry["reference_id"] for entry in entries if entry["status"] == "submitted"}
    assert done == submitted == set(service.results)  # each row's own transaction, recorded before done

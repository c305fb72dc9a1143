"""bench.load_client against a real HTTP server on 127.0.0.1 answering from test_client's scripted service:
the SDK's behaviour (login, retries, polling, parsing) and its requests must come through the aiohttp
transport unchanged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import httpx
from aiohttp import web

from bench.load_client import AiohttpFaceSearchClient, Credentials, LoadGenerator, PhaseResult, split
from facesearch_client import AgeResult, FaceSearchResult, Pending
from tests.unit.test_client import (
    CLIENT_ID,
    REF,
    SECRET,
    Service,
    envelope,
    queue_a_search_through_an_outage_and_an_expiry,
)


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[str]:
    """The scripted service behind an aiohttp server on 127.0.0.1; yields its base URL."""

    async def answer(request: web.Request) -> web.Response:
        scripted = service(
            httpx.Request(
                request.method,
                str(request.url),
                headers=list(request.raw_headers),
                content=await request.read(),
            )
        )
        headers = {key: value for key, value in scripted.headers.items() if key != "content-length"}
        return web.Response(status=scripted.status_code, body=scripted.content, headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_the_sdk_behaves_the_same_over_aiohttp() -> None:
    async def scenario() -> None:
        service = Service()
        slept: list[float] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)

        async with (
            serving(service) as base_url,
            aiohttp.ClientSession(base_url) as session,
            AiohttpFaceSearchClient(session, client_id=CLIENT_ID, client_secret=SECRET, sleep=sleep) as api,
        ):
            queue_a_search_through_an_outage_and_an_expiry(service)
            result = await api.search(b"\xff\xd8 jpeg", client_reference="customer-1", as_json=True)
            assert isinstance(result, FaceSearchResult) and result.reference_id == REF
            assert result.is_face_found and result.matches[0].client_reference == "customer-9"
            assert slept == [2.0] and service.logins == 2
            created = service.sent("/face-search")[-1]
            assert created.headers["authorization"] == "Bearer token-1"
            assert created.headers["content-type"] == "application/json"
            body = json.loads(created.content)
            assert body["type"] == "face_search" and body["client_reference"] == "customer-1"
            assert body["file"].startswith("data:image/jpeg;base64,")
            assert [poll.headers["prefer"] for poll in service.sent("/result")] == ["wait=10"] * 3

            service.queue(
                "/result", httpx.Response(202, json=envelope({"reference_id": REF, "state": "queued"}))
            )
            assert await api.result(REF, wait_s=2) == Pending(REF, "queued")

            age = {"reference_id": REF, "age": 34, "under_18": 0, "under_21": 0}
            service.queue("/age-estimation", httpx.Response(200, json=envelope(age)))
            assert await api.age_estimation(b"\xff\xd8 jpeg", enroll_face=False) == AgeResult(
                REF, 34, 0, 0, raw=age
            )
            upload = service.sent("/age-estimation")[0]
            assert upload.headers["content-type"].startswith("multipart/form-data")
            for part in (b'name="wait_for_result"\r\n\r\n1', b'name="enroll_face"\r\n\r\n0'):
                assert part in upload.content
            assert b'filename="image.jpg"' in upload.content and b"\xff\xd8 jpeg" in upload.content

    asyncio.run(scenario())


def test_split_spreads_clients_over_processes_without_empty_parts() -> None:
    assert split(8, 4) == [2, 2, 2, 2]
    assert split(10, 4) == [3, 3, 2, 2]
    assert split(3, 4) == [1, 1, 1]  # fewer clients than processes: only as many processes as clients
    assert split(1, 1) == [1]


async def _answer_every_search(request: web.Request) -> web.Response:
    """A service that logs anyone in and answers every create with its result (Prefer: wait honoured)."""
    if request.path == "/request-access-token":
        return web.json_response(envelope({"token": "t", "token_type": "Bearer", "expires_in": 900}))
    assert request.path == "/face-search" and request.headers["Prefer"] == "wait=10"
    data = {
        "service_reference_id": REF,
        "client_reference": "x",
        "face_search_response": {"result": {"matched_faces": [], "is_face_found": True}},
    }
    return web.json_response(envelope(data), headers={"Preference-Applied": "wait=10"})


def test_the_load_generator_spreads_a_phase_over_its_processes(tmp_path: Path) -> None:
    photo = tmp_path / "face.jpg"
    photo.write_bytes(b"\xff\xd8 jpeg")

    async def scenario() -> PhaseResult:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", _answer_every_search)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            # The generator's calls block on its pipes: off this loop, which serves the requests.
            return await asyncio.to_thread(run_one_phase, base_url, photo)
        finally:
            await runner.cleanup()

    phase = asyncio.run(scenario())
    assert phase.per_process == [2, 1]  # 3 clients over 2 processes
    assert len(phase.latencies) == 12 and phase.failures == 0
    assert phase.client_cpu_s > 0 and phase.busiest_client_share > 0
    assert phase.elapsed_s >= max(phase.latencies)


def run_one_phase(base_url: str, photo: Path) -> PhaseResult:
    with LoadGenerator(base_url, Credentials(CLIENT_ID, SECRET), [photo], [photo], processes=2) as load:
        assert len(load.pids) == 2
        return load.run("face-search (one request)", requests=12, concurrency=3, timeout_s=60)

"""The benchmarks' load generator: the SDK's client with its HTTP exchanges sent over aiohttp, run from
several processes.

A one-box benchmark's clients take CPU from the service they measure. The SDK sends its requests with
httpx, which on the 2-core box costs 0.81-0.83 ms of client CPU per request against 0.13-0.14 ms for aiohttp
(2,000 JSON requests with a 75 KB body to a bare uvicorn app, 8 at a time). Everything else is the SDK's own
code (the requests built by facesearch_client.calls, its login, retry policy, polling and result parsing),
so the service sees the same requests either way.

One process with one connection pool could itself become the limit (its event loop, or a pool smaller than
the client count queueing requests on the client side). LoadGenerator spreads the clients of a phase over
`processes` worker processes, each with its own event loop and an unlimited aiohttp pool (each client has
at most one request in flight, so a process opens as many connections as it has clients), and reports each
phase's latencies together with what the clients cost: the CPU of every worker process, and the busiest
one's share of a core (near 100 % means the client, not the service, set the pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from facesearch_client import AsyncFaceSearchClient, Pending, RetryPolicy
from facesearch_client.calls import Call

CREATE_WAIT_S = 10.0  # the one-request search's Prefer: wait, and the long polls' wait


class AiohttpFaceSearchClient(AsyncFaceSearchClient):
    """AsyncFaceSearchClient whose requests go out on an aiohttp session (its base URL and connection
    limits are the caller's); answers are handed back as httpx responses, so the SDK reads them unchanged."""

    def __init__(self, http: aiohttp.ClientSession, **options: Any) -> None:
        """options: AsyncFaceSearchClient's (credentials, retry, clock, sleep), all but its httpx client,
        which it then makes, never uses and closes."""
        super().__init__(**options)
        self._aiohttp = http

    async def _exchange(self, call: Call, headers: dict[str, str]) -> httpx.Response:
        body: bytes | aiohttp.FormData | None = None
        if call.json is not None:
            body = orjson.dumps(call.json)
            headers = {**headers, "Content-Type": "application/json"}
        elif call.files is not None or call.data is not None:
            form = aiohttp.FormData()
            for name, value in (call.data or {}).items():
                form.add_field(name, value)
            for name, (filename, content, content_type) in (call.files or {}).items():
                form.add_field(name, content, filename=filename, content_type=content_type)
            body = form
        async with self._aiohttp.request(
            call.method, call.path, data=body, params=call.params, headers=headers
        ) as answer:
            content = await answer.read()
            return httpx.Response(answer.status, headers=list(answer.raw_headers), content=content)


# Each kind of call: the ServiceCalls method that makes it, and the workload its photos come from.
CALL_KINDS = {
    "face-search (one request)": ("search_one_request", "faces"),
    "face-search (create+long poll)": ("search_long_poll", "faces"),
    "face-search (create+poll)": ("search", "faces"),
    "age (wait_for_result=1)": ("age_wait", "ages"),
    "age (create+poll)": ("age_poll", "ages"),
}


class ServiceCalls:
    """One client transaction per call, as the benchmark's clients make them (through facesearch_client,
    with no retries so a refused call counts as a failure); `index` picks the photo."""

    def __init__(
        self, client: AsyncFaceSearchClient, faces: list[bytes], ages: list[bytes], timeout_s: float
    ) -> None:
        self._client = client
        self._faces = faces
        self._ages = ages
        self._timeout_s = timeout_s

    def call(self, kind: str) -> Callable[[int], Awaitable[None]]:
        method: Callable[[int], Awaitable[None]] = getattr(self, CALL_KINDS[kind][0])
        return method

    async def search_one_request(self, index: int) -> None:
        # Prefer: wait on the create: the result in its own answer, a long poll only when not final in time.
        answer = await self._client.face_search(
            self._faces[index % len(self._faces)], wait_s=CREATE_WAIT_S, **self._search_options(index)
        )
        if isinstance(answer, str):
            await self._client.wait(answer, self._timeout_s, long_poll_s=CREATE_WAIT_S)

    async def search(self, index: int) -> None:
        # Polite polling: 50 ms growing to 400 ms between polls.
        await self._client.wait(await self._create_search(index), self._timeout_s, long_poll_s=None)

    async def search_long_poll(self, index: int) -> None:
        await self._client.wait(await self._create_search(index), self._timeout_s, long_poll_s=CREATE_WAIT_S)

    async def age_poll(self, index: int) -> None:
        photo = self._ages[index % len(self._ages)]
        reference_id = await self._client.submit_age_estimation(photo, enroll_face=False)
        await self._client.wait(reference_id, self._timeout_s, long_poll_s=None)

    async def age_wait(self, index: int) -> None:
        answer = await self._client.age_estimation(self._ages[index % len(self._ages)], enroll_face=False)
        if isinstance(answer, Pending):
            raise RuntimeError(f"{answer.reference_id} not final within wait_for_result")

    @staticmethod
    def _search_options(index: int) -> dict[str, Any]:
        return {"as_json": True, "enroll_face": index % 4 == 0, "client_reference": f"bench-{index % 50:04d}"}

    async def _create_search(self, index: int) -> str:
        return await self._client.submit_face_search(
            self._faces[index % len(self._faces)], **self._search_options(index)
        )


async def run_calls(
    call: Callable[[int], Awaitable[None]], indices: range, concurrency: int, timeout_s: float
) -> tuple[list[float], int]:
    """`concurrency` clients making the calls of `indices` one after another; the latencies of those
    that succeeded, and how many failed (a call still running at timeout_s counts as failed)."""
    latencies: list[float] = []
    failures = 0
    counter = iter(indices)

    async def client() -> None:
        nonlocal failures
        for index in counter:
            started = time.perf_counter()
            try:
                await call(index)
                latencies.append(time.perf_counter() - started)
            except Exception:
                failures += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))), timeout_s)
    except TimeoutError:
        failures = len(indices) - len(latencies)
    return latencies, failures


# ----- several processes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    client_id: str
    client_secret: str


@dataclass(frozen=True)
class _Setup:
    base_url: str
    credentials: Credentials
    faces: tuple[str, ...]  # photo paths, read in the worker
    ages: tuple[str, ...]


@dataclass(frozen=True)
class _Share:
    """One process' part of a phase."""

    kind: str
    indices: range
    concurrency: int
    timeout_s: float


@dataclass(frozen=True)
class _Done:
    started: float  # time.monotonic(): one clock for every process of the machine
    ended: float
    latencies: list[float]
    failures: int
    cpu_s: float


@dataclass
class PhaseResult:
    elapsed_s: float
    latencies: list[float]
    failures: int
    client_cpu_s: float  # all the worker processes together
    busiest_client_share: float  # the busiest worker's CPU over the phase, as a share of one core
    per_process: list[int] = field(default_factory=list)  # clients per process


def split(total: int, parts: int) -> list[int]:
    """total spread over at most `parts` parts as evenly as possible, no part empty (fewer parts when
    total < parts)."""
    parts = max(1, min(parts, total))
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def default_processes() -> int:
    """A worker process per 4 cores, at least 2: a client's CPU is a few percent of a search's."""
    return max(2, (os.cpu_count() or 1) // 4)


class LoadGenerator:
    """Worker processes that stay up between phases (each logged in once, its connections kept alive):

    with LoadGenerator(base_url, credentials, faces, ages, processes=4) as load:
        result = load.run("face-search (one request)", requests=192, concurrency=32, timeout_s=300)
    """

    def __init__(
        self,
        base_url: str,
        credentials: Credentials,
        faces: list[Path],
        ages: list[Path],
        processes: int | None = None,
    ) -> None:
        self._setup = _Setup(
            base_url, credentials, tuple(str(path) for path in faces), tuple(str(path) for path in ages)
        )
        self._count = processes or default_processes()
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        self._next_index = 0

    def __enter__(self) -> LoadGenerator:
        context = multiprocessing.get_context("spawn")  # no copy of the parent's Ray or event loop state
        for _ in range(self._count):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(child, self._setup), daemon=True)
            process.start()
            child.close()
            self._workers.append((process, parent))
        try:
            for worker, connection in self._workers:
                try:
                    answer = connection.recv()  # "ready" once logged in, or the error that stopped it
                except EOFError:
                    answer = f"exited with {worker.exitcode}"
                if answer != "ready":
                    raise RuntimeError(f"load worker {worker.pid} did not start: {answer}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for _process, connection in self._workers:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process, connection in self._workers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
            connection.close()
        self._workers.clear()

    @property
    def pids(self) -> set[int]:
        return {process.pid for process, _ in self._workers if process.pid is not None}

    def run(self, kind: str, requests: int, concurrency: int, timeout_s: float) -> PhaseResult:
        """One phase: `requests` calls of `kind` by `concurrency` clients spread over the processes."""
        clients = split(concurrency, len(self._workers))
        shares = [round(requests * part / concurrency) for part in clients]
        shares[-1] = requests - sum(shares[:-1])
        busy = self._workers[: len(clients)]
        first = self._next_index
        for (_process, connection), part, count in zip(busy, clients, shares, strict=True):
            connection.send(_Share(kind, range(first, first + count), part, timeout_s))
            first += count
        self._next_index = first
        for _process, connection in busy:
            assert connection.recv() == "set"
        for _process, connection in busy:
            connection.send("go")
        done: list[_Done] = [connection.recv() for _process, connection in busy]
        elapsed = max(item.ended for item in done) - min(item.started for item in done)
        return PhaseResult(
            elapsed_s=elapsed,
            latencies=[latency for item in done for latency in item.latencies],
            failures=sum(item.failures for item in done),
            client_cpu_s=sum(item.cpu_s for item in done),
            busiest_client_share=max(item.cpu_s / max(1e-9, item.ended - item.started) for item in done),
            per_process=clients,
        )


def _worker_main(connection: Connection, setup: _Setup) -> None:
    try:
        faces = [Path(path).read_bytes() for path in setup.faces]
        ages = [Path(path).read_bytes() for path in setup.ages]
        asyncio.run(_worker(connection, setup, faces, ages))
    except Exception as error:  # reported to the parent, which raises it
        connection.send(f"{type(error).__name__}: {error}")


async def _worker(connection: Connection, setup: _Setup, faces: list[bytes], ages: list[bytes]) -> None:
    # limit=0: no cap, so the pool is as large as this process' client count (one request in flight each).
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(setup.base_url, connector=connector, timeout=timeout) as session,
        AiohttpFaceSearchClient(
            session,
            client_id=setup.credentials.client_id,
            client_secret=setup.credentials.client_secret,
            retry=RetryPolicy(max_retries=0),
        ) as client,
    ):
        await client.login()
        connection.send("ready")
        while True:
            # Blocking reads between phases: nothing else runs on this loop then.
            share: _Share | None = connection.recv()
            if share is None:
                return
            call = ServiceCalls(client, faces, ages, share.timeout_s).call(share.kind)
            connection.send("set")
            connection.recv()  # "go": every process starts together
            started, cpu_started = time.monotonic(), time.process_time()
            latencies, failures = await run_calls(call, share.indices, share.concurrency, share.timeout_s)
            connection.send(
                _Done(started, time.monotonic(), latencies, failures, time.process_time() - cpu_started)
            )

"""The asynchronous client (asyncio): the same calls as FaceSearchClient, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

import httpx

from facesearch_client import calls
from facesearch_client._policy import RetryPolicy, Session, created_outcome, outcome
from facesearch_client.calls import Call, Image
from facesearch_client.errors import ResultTimeout
from facesearch_client.models import (
    AgeResult,
    AuditPage,
    Erasure,
    FaceSearchResult,
    GalleryFace,
    GalleryPage,
    GalleryStats,
    Pending,
    Result,
    parse_audit_page,
    parse_gallery_page,
    parse_result,
)


class AsyncFaceSearchClient:
    """client = AsyncFaceSearchClient("http://127.0.0.1:8000", client_id, client_secret)
    result = await client.search("selfie.jpg", client_reference="customer-1")  # FaceSearchResult

    mode="secret" sends the Client-Secret header instead of logging in. `http` may be an httpx.AsyncClient of
    your own (its base_url is used; event hooks, limits and transports stay yours)."""

    def __init__(
        self,
        base_url: str | None = None,
        client_id: str | None = None,
        client_secret: str | None = None,
        *,
        mode: str = "token",
        token: str | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        http: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Any = asyncio.sleep,
    ) -> None:
        self.session = Session(client_id, client_secret, mode, token, clock=clock)
        self.retry = retry or RetryPolicy()
        self._owns_http = http is None
        self._http = (
            http if http is not None else httpx.AsyncClient(base_url=base_url or "", timeout=timeout_s)
        )
        self._sleep = sleep

    async def __aenter__(self) -> AsyncFaceSearchClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    # -- transport ---------------------------------------------------------------------------------------

    async def _attempts(self, call: Call, headers: dict[str, str]) -> httpx.Response:
        retries = 0
        while True:
            try:
                response = await self._exchange(call, {**call.headers, **headers})
            except httpx.TransportError as error:
                broken = self.retry.resend_delay(call, error, retries)
                if broken is None:
                    raise
                retries += 1
                await self._sleep(broken)
                continue
            delay = self.retry.delay(response, retries)
            if delay is None:
                return response
            retries += 1
            await self._sleep(delay)

    async def _exchange(self, call: Call, headers: dict[str, str]) -> httpx.Response:
        """One HTTP request and its answer: the only place that touches the transport."""
        return await self._http.request(
            call.method,
            call.path,
            json=call.json,
            data=call.data,
            files=call.files,
            params=call.params,
            headers=headers,
        )

    async def login(self) -> None:
        self.session.accept_login(await self._attempts(self.session.login_call(), {}))

    async def send(self, call: Call) -> httpx.Response:
        """One call with credentials, retried on 429/503/507 and on a broken connection as the RetryPolicy
        says, with one fresh login after a 401. Returns the last response whatever its status (a 429/503
        once retries are spent); a broken connection that may not be resent is raised."""
        if not call.authenticated:
            return await self._attempts(call, {})
        if self.session.needs_login():
            await self.login()
        response = await self._attempts(call, self.session.headers())
        if response.status_code == 401 and self.session.can_login:
            self.session.forget_token()
            await self.login()
            response = await self._attempts(call, self.session.headers())
        return response

    async def _data(self, call: Call) -> dict[str, Any]:
        return calls.data_of(await self.send(call))

    # -- the interface -----------------------------------------------------------------------------------

    async def submit_face_search(self, image: Image, **options: Any) -> str:
        """Create a face search transaction; its reference_id. Options: client_reference, allow_override,
        enroll_face, as_json, filename, idempotency_key (calls.face_search: by default a new key that every
        retry of this call reuses)."""
        return str((await self._data(calls.face_search(image, **options)))["reference_id"])

    async def submit_age_estimation(
        self, image: Image, *, enroll_face: bool | None = None, idempotency_key: str | None = None
    ) -> str:
        call = calls.age_estimation(image, enroll_face=enroll_face, idempotency_key=idempotency_key)
        return str((await self._data(call))["reference_id"])

    async def age_estimation(
        self, image: Image, *, enroll_face: bool | None = None, idempotency_key: str | None = None
    ) -> AgeResult | Pending:
        """wait_for_result=1: the age in the same request, or Pending when it was not final in time."""
        call = calls.age_estimation(
            image, enroll_face=enroll_face, wait_for_result=True, idempotency_key=idempotency_key
        )
        answer = outcome(await self.send(call))
        assert not isinstance(answer, FaceSearchResult)
        return answer

    async def result(self, reference_id: str, wait_s: float | None = None) -> Result | Pending:
        return outcome(await self.send(calls.result(reference_id, wait_s)))

    async def wait(
        self, reference_id: str, timeout_s: float = 120.0, long_poll_s: float | None = 10.0
    ) -> Result:
        """The final result: long polls of up to long_poll_s each (None: short polls backing off from
        50 to 400 ms). ResultTimeout after timeout_s; TransactionFailed for a failed transaction."""
        deadline = time.monotonic() + timeout_s
        interval = 0.05
        while True:
            left = deadline - time.monotonic()
            wait_s = min(long_poll_s, max(1.0, left)) if long_poll_s else None
            answer = await self.result(reference_id, wait_s)
            if not isinstance(answer, Pending):
                return answer
            if time.monotonic() >= deadline:
                raise ResultTimeout(f"transaction {reference_id} not final after {timeout_s:g} s")
            if long_poll_s is None:
                await self._sleep(interval)
                interval = min(0.4, interval * 1.5)

    async def face_search(self, image: Image, wait_s: float = 10.0, **options: Any) -> FaceSearchResult | str:
        """Create a face search and have the service hold the same request up to wait_s seconds
        (`Prefer: wait`): the result when it is final in time, else the reference_id to wait() for.
        Options as submit_face_search; a retry (503, 429, a fresh login) sends the same Idempotency-Key,
        so it answers the same transaction's result."""
        call = calls.face_search(image, wait_s=wait_s, **options)
        answer = created_outcome(await self.send(call))
        assert not isinstance(answer, AgeResult)
        return answer

    async def search(self, image: Image, timeout_s: float = 120.0, **options: Any) -> FaceSearchResult:
        """One request when the result is ready within 10 s (face_search), else long polls of /result up
        to timeout_s in all."""
        started = time.monotonic()
        answer = await self.face_search(image, wait_s=min(10.0, timeout_s), **options)
        if not isinstance(answer, str):
            return answer
        result = await self.wait(answer, max(0.0, timeout_s - (time.monotonic() - started)))
        assert isinstance(result, FaceSearchResult)
        return result

    async def proof(self, url: str) -> bytes:
        """The proof image behind a proof URL (the URL is its own credential)."""
        response = await self._http.get(url)
        if response.status_code != 200:
            raise calls.error_of(response)
        return response.content

    # -- gallery management (extension) ------------------------------------------------------------------

    async def list_faces(
        self, client_reference: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> GalleryPage:
        return parse_gallery_page(await self._data(calls.list_faces(client_reference, limit, cursor)))

    async def iter_faces(
        self, client_reference: str | None = None, page_size: int = calls.MAX_PAGE_SIZE
    ) -> AsyncIterator[GalleryFace]:
        cursor: str | None = None
        while True:
            page = await self.list_faces(client_reference, page_size, cursor)
            for face in page.faces:
                yield face
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def delete_face(self, face_id: str) -> None:
        await self._data(calls.delete_face(face_id))

    async def erase(self, client_reference: str) -> Erasure:
        return Erasure(**await self._data(calls.erase(client_reference)))

    async def gallery_stats(self) -> GalleryStats:
        return GalleryStats(**await self._data(calls.gallery_stats()))

    async def audit(self, limit: int | None = None, cursor: str | None = None) -> AuditPage:
        return parse_audit_page(await self._data(calls.audit(limit, cursor)))


__all__ = ["AsyncFaceSearchClient", "parse_result"]

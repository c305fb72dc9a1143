"""The benchmarks' load generator: the SDK's client with its HTTP exchanges sent over aiohttp.

A one-box benchmark's clients take CPU from the service they measure. The SDK sends its requests with
httpx, which on the 2-core box costs 0.81-0.83 ms of client CPU per request against 0.13-0.14 ms for aiohttp
(2,000 JSON requests with a 75 KB body to a bare uvicorn app, 8 at a time): about 1.4 ms of a face search's
56-58 ms, with two requests per search. Everything else is the SDK's own code (the requests built by
facesearch_client.calls, its login, retry policy, polling and result parsing), so the service sees the same
requests either way; `--client sdk` measures through httpx as before.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx
import orjson

from facesearch_client import AsyncFaceSearchClient
from facesearch_client.calls import Call


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
